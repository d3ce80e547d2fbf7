"""mplab: the library behind the mixed precision lessons."""
