"""The kernel's nftables through libnftables (libnftables.so.1, Debian's libnftables1), JSON in and out.

The same library ``nft`` and Debian's python3-nftables use, loaded here through ctypes:
python3-nftables lives in Debian's /usr/lib/python3/dist-packages, which neither a virtualenv
nor the python:3.11 container image sees, while the library itself is always there where
nftables is installed.  The API is small (``nft_ctx_new``, ``nft_run_cmd_from_buffer`` with
JSON, buffered output and errors, see libnftables(3)); each call is one netlink batch, so a
command list is one atomic transaction: it all applies, or none of it does.

Each :class:`Nft` owns one context on one worker thread (libnftables is not thread-safe per
context, and its calls block); with ``netns`` the thread enters that network namespace
first (tests program namespaces they made; the agent runs inside its own).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import json
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from agentd.kernel.heap import malloc_trim

from .nfnetlink import ElementWriter
from .ruleset import command_json

# include/nftables/libnftables.h
NFT_CTX_DEFAULT = 0
NFT_CTX_OUTPUT_HANDLE = 1 << 3
NFT_CTX_OUTPUT_JSON = 1 << 4
NFT_CTX_OUTPUT_NUMERIC_PROTO = 1 << 7
NFT_CTX_OUTPUT_NUMERIC_PRIO = 1 << 8
NFT_CTX_OUTPUT_NUMERIC_SYMBOL = 1 << 9
CLONE_NEWNET = 0x40000000
# A transaction this large (the first sync of a table, a rewrite after a refusal: Services'
# prepared slots are ~190 kB of JSON dual-stack) leaves libnftables' parse tree, ~30x its
# text, freed in glibc's heap but still resident; it is handed back after such a call.
TRIM_AFTER_BYTES = 64 << 10

_lib: ctypes.CDLL | None = None
_lib_error: str | None = None
_lib_lock = threading.Lock()


class NftError(RuntimeError):
    """libnftables refused a command list; the message is its error output (first lines)."""


def load() -> ctypes.CDLL:
    """libnftables.so.1 with its prototypes; NftError if it is not installed."""
    global _lib, _lib_error
    with _lib_lock:
        if _lib is not None:
            return _lib
        if _lib_error is not None:
            raise NftError(_lib_error)
        name = ctypes.util.find_library("nftables") or "libnftables.so.1"
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError as err:
            _lib_error = f"cannot load libnftables ({name}): {err}; install Debian's libnftables1 (nftables)"
            raise NftError(_lib_error) from None
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_free.restype = None
        lib.nft_ctx_output_get_flags.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_output_get_flags.restype = ctypes.c_uint
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        lib.nft_ctx_output_set_flags.restype = None
        for fn in ("nft_ctx_buffer_output", "nft_ctx_buffer_error"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p]
            getattr(lib, fn).restype = ctypes.c_int
        for fn in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p]
            getattr(lib, fn).restype = ctypes.c_char_p
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
        _lib = lib
        return lib


class Nft:
    """One libnftables context, used from one thread (optionally inside ``netns``)."""

    def __init__(self, netns: str | None = None) -> None:
        self.netns = netns
        self._lib = load()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nft")
        self._ctx: int | None = None
        self.calls = 0
        self._executor.submit(self._open).result()

    def _open(self) -> None:
        if self.netns is not None:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(self.netns, os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise NftError(f"cannot enter network namespace {self.netns}: {os.strerror(err)}")
            finally:
                os.close(fd)
        ctx = self._lib.nft_ctx_new(NFT_CTX_DEFAULT)
        if not ctx:
            raise NftError("nft_ctx_new failed")
        flags = NFT_CTX_OUTPUT_JSON | NFT_CTX_OUTPUT_HANDLE | NFT_CTX_OUTPUT_NUMERIC_PROTO | NFT_CTX_OUTPUT_NUMERIC_PRIO
        self._lib.nft_ctx_output_set_flags(ctx, flags)
        self._lib.nft_ctx_buffer_output(ctx)
        self._lib.nft_ctx_buffer_error(ctx)
        self._ctx = ctx
        # Element-only transactions skip libnftables (and its cache): agentd.nft.nfnetlink.
        self._elements = ElementWriter()

    def _run(self, text: str) -> str:
        if self._ctx is None:
            raise NftError("the nftables context is closed")
        self.calls += 1
        large = len(text) >= TRIM_AFTER_BYTES
        if large:  # what the caller freed making the text, before libnftables' parse sits on it
            malloc_trim()
        rc = self._lib.nft_run_cmd_from_buffer(self._ctx, text.encode())
        out = (self._lib.nft_ctx_get_output_buffer(self._ctx) or b"").decode(errors="replace")
        err = (self._lib.nft_ctx_get_error_buffer(self._ctx) or b"").decode(errors="replace")
        if large:
            malloc_trim()
        if rc != 0:
            lines = [line for line in err.strip().splitlines() if line.strip()]
            raise NftError(" | ".join(lines[:3]) or f"nft_run_cmd_from_buffer returned {rc}")
        return out

    @staticmethod
    def encode(commands: list[dict[str, Any]]) -> str:
        """A command list as libnftables' JSON input (one transaction).  Command by command:
        one ``json.dumps`` of the whole list holds every fragment of the text at once (~1.5 MB
        of small strings for Services' 190 kB first sync) before it joins them."""
        head = json.dumps({"metainfo": {"json_schema_version": 1}})
        return '{"nftables": [' + ", ".join([head, *map(command_json, commands)]) + "]}"

    def run(self, commands: list[dict[str, Any]]) -> dict[str, Any] | None:
        """Run a JSON command list as one transaction (blocking); returns parsed output, if any."""
        out = self._executor.submit(self._run, self.encode(commands)).result()
        return json.loads(out) if out.strip() else None

    async def arun(self, commands: list[dict[str, Any]]) -> dict[str, Any] | None:
        """:meth:`run` without blocking the event loop."""
        return await self.arun_text(self.encode(commands))

    async def arun_text(self, text: str) -> dict[str, Any] | None:
        """:meth:`arun` of commands already :meth:`encode`d: the caller can let go of a large
        command list's objects before libnftables builds its own from the text."""
        loop = asyncio.get_running_loop()
        out = await loop.run_in_executor(self._executor, self._run, text)
        return json.loads(out) if out.strip() else None

    def run_elements(self, ops: list[Any]) -> None:
        """Set element adds and deletes as one netlink transaction (blocking)."""
        self._executor.submit(self._send_elements, ops).result()

    async def arun_elements(self, ops: list[Any]) -> None:
        """Set element adds and deletes as one netlink transaction (see agentd.nft.nfnetlink)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._send_elements, ops)

    def _send_elements(self, ops: list[Any]) -> None:
        self.calls += 1
        try:
            self._elements.send(ops)
        except (OSError, ValueError, struct.error) as err:  # struct.error: a field that does not fit its encoding
            raise NftError(str(err)) from None

    async def acounters(self, family: str, table: str) -> dict[str, tuple[int, int]]:
        """(packets, bytes) of the named counters of a table, over netlink (no cache fetch)."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, self._elements.counters, family, table)
        except (OSError, ValueError) as err:  # ValueError: a malformed answer (nl.NetlinkDecodeError)
            raise NftError(str(err)) from None

    async def alist(self, what: dict[str, Any]) -> list[dict[str, Any]] | None:
        try:
            out = await self.arun([{"list": what}])
        except NftError as err:
            if "No such file or directory" in str(err):
                return None
            raise
        return (out or {}).get("nftables", [])

    def close(self) -> None:
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            self._executor.submit(self._lib.nft_ctx_free, ctx).result()
            self._elements.close()
        self._executor.shutdown(wait=True)
