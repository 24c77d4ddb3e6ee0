"""Builds the data plane's optional C fast path; everything else is in pyproject.toml.

The extension is optional: where it cannot be built the workers run the Python (numpy) path
and say so in /status.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "agentd.dataplane._fastpath",
            ["agentd/dataplane/_fastpath.c"],
            extra_compile_args=["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        )
    ]
)
