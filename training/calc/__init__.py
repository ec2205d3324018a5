"""The memory calculator: will a model and a setup fit a device, and what will a peer send?

    memory.py    the arithmetic, without torch: parameters, gradients, optimizer state, activations, buffers
    command.py   `ttt calc` and the Join page's /api/calc: options -> the estimate, as a table or JSON
    measure.py   the same terms measured on real tensors (tests and `python -m bench.calc` hold the arithmetic to it)
"""
