"""The console scripts (pyproject.toml ``[project.scripts]``): ``agentd`` and ``agentd-cni``.

Ctrl-C ends a command quietly with exit status 130 (128 + SIGINT) at any moment -- also while
its modules load, which is most of a short command's life (``agentd.cli`` with the
configuration model takes a few hundred milliseconds to import on a loaded host).  So this
module imports nothing until it can catch the KeyboardInterrupt; before the interpreter has
installed its SIGINT handler, SIGINT's default action ends the process, quietly too.  Once the
command is done, SIGINT goes back to that default action: a Ctrl-C while the interpreter shuts
down ends it at once (what a shell reports as 130) rather than with a traceback."""

INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command that SIGINT ended


def agentd() -> int:
    try:
        from agentd.cli import main

        return _done(main())
    except KeyboardInterrupt:
        return _done(INTERRUPTED)


def agentd_cni() -> int:
    try:
        from agentd.cni.plugin import main

        return _done(main())
    except KeyboardInterrupt:
        return _done(INTERRUPTED)


def _done(code: int) -> int:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    return code
