"""The collaborative trainer: the model, one hivemind peer, its metrics and checkpoints.

hivemind 1.1.12 and bitsandbytes warn on import about APIs their users cannot change
(torch.jit.script and quantize_per_tensor deprecations, an optional 4-bit CPU kernel, the
order in which hivemind steps a downloaded scheduler);
those warnings are silenced here so that a volunteer's console shows the run.
"""

import logging
import warnings

warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*", category=FutureWarning)
warnings.filterwarnings("ignore", message=r".*quantize_per_tensor.*", category=UserWarning)
# hivemind steps a freshly loaded scheduler before its optimizer when it downloads state from peers.
warnings.filterwarnings("ignore", message=r".*lr_scheduler\.step\(\)` before `optimizer\.step\(\)`.*")
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
