"""The console scripts (pyproject.toml ``[project.scripts]``): ``agentd`` and ``agentd-cni``.

Ctrl-C ends a command quietly with exit status 130 (128 + SIGINT) at any moment -- also while
its modules load, which is most of a short command's life (``agentd.cli`` with the
configuration model takes a few hundred milliseconds to import on a loaded host).  So this
module imports nothing until it can catch the KeyboardInterrupt; before the interpreter has
installed its SIGINT handler, SIGINT's default action ends the process, quietly too.  Once the
command is done, SIGINT goes back to that default action: a Ctrl-C while the interpreter shuts
down ends it at once (what a shell reports as 130) rather than with a traceback.

SIGHUP is the daemons' reload (``agentd run``, ``agentd speaker``; the unit's ExecReload= and
logrotate's postrotate, docs/ingress.md, send it at any time).  Its default action ends the
process, and systemd counts that as a clean exit: Restart=on-failure would not start the agent
again.  So for those two commands it is ignored first thing, before the imports, the
configuration load and the API start (a second or so), until the daemon installs its reload
handler, and again once the daemon removed it at its stop.  A SIGHUP so ignored is lost:
nothing to re-read yet (the configuration and an access log file are read and opened after the
handler is in place), and ``systemctl reload`` waits for the start to finish anyway."""

INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command that SIGINT ended
DAEMONS = ("run", "speaker")  # the commands whose SIGHUP is a reload


def agentd() -> int:
    try:
        if _command() in DAEMONS:
            import signal

            signal.signal(signal.SIGHUP, signal.SIG_IGN)
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


def _command() -> str | None:
    """The sub-command the command line names: its first word that is no option (as
    ``agentd.cli``, which is not imported yet, parses it; only ``--version`` and ``--help``
    come before it, and they take no value)."""
    import sys

    return next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None)


def _done(code: int) -> int:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    return code
