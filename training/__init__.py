"""The collaborative trainer, in floors: a module imports only from the floors below its own (tests/test_layout.py).

    config.py       settings and presets (no torch): `RunSettings`, what every peer of a run shares, nested in
                    the peer's and the monitor's settings, and `RunSpec`, the same as its organiser signed them
    model.py        the DALL-E-like transformer          optimizer.py  the 8-bit LAMB and the schedule
    metrics.py      the signed records peers publish in the DHT
    checkpoint.py   checkpoints on disk                  auth/         admission to a run (tokens, keys, server)
    spec.py         the run spec: the run's settings written once (`ttt run init`), signed, read by `--join`
    swarm/          everything that extends or overrides hivemind, and the one door to it: the rest holds a
                    `SwarmMember` (docs/design/hivemind-overrides.md lists each override)
    audit/          work that is checked: commitments, audits, verdicts (beside swarm/, which asks it whom to refuse)
    calc/           the memory calculator
    peer/           `ttt train`: the loop and its collaborators          monitor/  `ttt monitor`
    (peer/ and monitor/ stand side by side: what both need lives below them, in swarm/ and calc/)

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
