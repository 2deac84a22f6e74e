"""The one exception type trainmem raises for bad input.

Every message names the bad input and, where there is one, the fix. The CLI prints it as a
single line and exits with status 2; the Python API lets it propagate (it is a ValueError).
"""


class TrainmemError(ValueError):
    """Bad input: an unknown model, an impossible layout, a malformed config, ..."""
