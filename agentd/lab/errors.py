"""The lab's error: a stage or an operation on a running lab failed; the message says which."""


class LabError(RuntimeError):
    """A lab stage failed; the message names the stage."""
