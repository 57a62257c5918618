"""Per-phase cost accounting for the effect bench's service children (never loaded by a
service outside the bench: ``bench/effect_bench.py`` puts this directory first on the
children's ``PYTHONPATH`` only when it measures the breakdown).

Python imports ``sitecustomize`` at start-up, before ``python -m runtime_svc`` runs, so
this module can wrap :func:`services.db.transaction` before any service module does
``from services.db import transaction``. It then counts, while the process runs:

* **transactions** per *call site* (the first frame outside ``services/db.py`` and
  ``contextlib``: the function that opened the transaction) and per *component*;
* **statements** per call site (a SQLAlchemy ``before_cursor_execute`` listener,
  attributed to the transaction its asyncio task has open);
* **event-loop CPU** per *component*: every callback the loop runs is timed with
  ``time.thread_time`` and charged to the task it steps; a task's component is the
  outermost coroutine of the service packages on its await chain (a worker loop, the
  outbox dispatcher, a gRPC servicer method, a sweep); the CPU of the other threads
  (aiosqlite's, gRPC core's) is the process CPU minus the loop thread's.

``SIGUSR1`` writes the counters as JSON to ``$BENCH_PROFILE_DIR/<pid>.json`` (atomically);
the bench diffs two snapshots around its sequential effects.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

_OUT = os.environ.get("BENCH_PROFILE_DIR")
_PACKAGES = ("runtime_svc", "effect_owner_svc", "catalog_svc", "services")
#: Generic frames that name no phase (their caller does).
_SKIP_SITE = ("services/db.py", "contextlib.py", "services/outbox/store.py")
_SKIP_COMPONENT = {"service_main", "_serve", "serve", "main", "run_forever", "_main"}

txns: Counter[str] = Counter()
stmts: Counter[str] = Counter()
cpu: Counter[str] = Counter()
#: keyed by the task itself (weakly): an ``id()`` is reused by the next task
_open: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_labels: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_loop_thread: list[int] = []
_seq = [0]


def _in_packages(filename: str) -> str | None:
    for pkg in _PACKAGES:
        marker = f"/{pkg}/"
        if marker in filename:
            return pkg + "/" + filename.rsplit(marker, 1)[1]
    return None


def _site() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not any(name.endswith(s) for s in _SKIP_SITE) and _in_packages(name):
            return f"{_in_packages(name)}:{frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


def _component(task: asyncio.Task[Any]) -> str:
    coro: Any = task.get_coro()
    if getattr(coro, "__qualname__", "") == "BackgroundLoop.run":
        # one task per loop, named after it (``runtime-worker-0``, ``outbox-sweep``, …)
        return f"loop {task.get_name()}"
    found = None
    while coro is not None:
        code = getattr(coro, "cr_code", None) or getattr(coro, "gi_code", None)
        if code is not None:
            where = _in_packages(code.co_filename)
            if where and code.co_name not in _SKIP_COMPONENT:
                found = f"{where.rsplit('.py', 1)[0]}:{code.co_qualname}"
                break
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return found or f"other:{getattr(task.get_coro(), '__qualname__', '?')}"


def _task_label() -> str:
    try:
        task = asyncio.current_task()
    except RuntimeError:
        return "no loop"
    if task is None:
        return "loop callbacks"
    label = _labels.get(task)
    if label is None or label.startswith("other:"):
        label = _labels[task] = _component(task)
    return label


def _install() -> None:
    import sqlalchemy as sa

    from services import db
    from services.db_batch import statements_of

    original = db.transaction

    @asynccontextmanager
    async def transaction(engine: Any, *, readonly: bool = False) -> AsyncIterator[Any]:
        site = _site()
        task = asyncio.current_task()
        outer = _open.get(task) if task is not None else None
        if task is not None:
            _open[task] = site
        txns[f"{'r ' if readonly else 'w '}{site}"] += 1
        if task is not None and _labels.setdefault(task, _component(task)).startswith("other:"):
            # a gRPC handler (grpc's Cython wrapper hides its await chain): named after
            # the first transaction it opens
            _labels[task] = f"rpc {site}"
        try:
            async with original(engine, readonly=readonly) as conn:
                yield conn
        finally:
            if task is not None and outer is None:
                _open.pop(task, None)
            elif task is not None:
                _open[task] = outer

    db.transaction = transaction  # type: ignore[assignment]

    def on_statement(*args: Any) -> None:
        try:
            task = asyncio.current_task()
        except RuntimeError:
            task = None
        # A batched round trip of writes carries several statements (services/db_batch.py).
        count = len(statements_of(str(args[2])))
        stmts[_open.get(task, "outside a transaction") if task else "no task"] += count

    sa.event.listen(sa.engine.Engine, "before_cursor_execute", on_statement)

    handle_run = asyncio.events.Handle._run

    def timed_run(self: asyncio.events.Handle) -> None:
        if not _loop_thread:
            _loop_thread.append(threading.get_native_id())
        start = time.thread_time()
        handle_run(self)
        spent = time.thread_time() - start
        owner = getattr(self._callback, "__self__", None)
        if isinstance(owner, asyncio.Task):
            label = _labels.get(owner)
            if label is None or label.startswith("other:"):
                label = _labels[owner] = _component(owner)
        else:
            label = "loop callbacks"
        cpu[label] += spent

    asyncio.events.Handle._run = timed_run  # type: ignore[method-assign]

    def dump(*_: Any) -> None:
        _seq[0] += 1
        thread_cpu = 0.0
        if _loop_thread:
            stat = Path(f"/proc/self/task/{_loop_thread[0]}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            thread_cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        data = {
            "seq": _seq[0],
            "process_cpu_s": time.process_time(),
            "loop_thread_cpu_s": thread_cpu,
            "txns": dict(txns),
            "stmts": dict(stmts),
            "cpu_s": dict(cpu),
        }
        target = Path(str(_OUT)) / f"{os.getpid()}.json"
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(target)

    signal.signal(signal.SIGUSR1, dump)


if _OUT:
    _install()
