"""Automatic mixed precision, as torch does it (`torch.amp`), made visible.

    from mplab.amp import GradScaler          # a from-scratch twin of torch.amp.GradScaler
    from mplab.amp import trace, audit, capture
    trace.trace(model, batch, precision="bf16")   # the dtype every aten op ran in under autocast
    audit.audit(model, optimizer)             # did mixed precision really happen? codes + words
    capture.capture(model, batch)             # one step's activations, gradients, weight grads

`scaler` is the GradScaler (lesson 3), `trace` autocast's op lists and what ran (lesson 4),
`audit` the dtypes of weights, gradients, optimizer states and matmuls with the silent
fallbacks (lessons 5 and 6), `capture` a model's tensors in one real step (lessons 2 and 9).
The functions `trace`, `audit` and `capture` live in the modules of the same name.
"""

from mplab.amp import audit, capture, scaler, trace
from mplab.amp.audit import Audit
from mplab.amp.capture import Capture
from mplab.amp.scaler import GradScaler
from mplab.amp.trace import Trace, autocast_policy

__all__ = ["scaler", "trace", "audit", "capture", "GradScaler", "Trace", "autocast_policy",
           "Audit", "Capture"]
