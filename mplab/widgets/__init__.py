"""Thin ipywidgets views over the mplab library, one module per lesson.

A widget builds its controls, wires callbacks that call library functions, and returns;
every number it shows is computed by mplab.formats, mplab.plots and friends.
"""
