"""Put first on the engines' ``PYTHONPATH`` by ``benchmarks/e2e_vs_nixl.py``; changes no vLLM code. Two things,
each switched on by an environment variable:

* ``KVB_BENCH_NIXL_PTHR_DELAY_US``: NIXL agents get this progress-thread delay (NIXL's Python API hard-codes 0):
  ``nixl_cu12._api.nixlBind.nixlAgent`` is wrapped so that every agent vLLM's NixlConnector creates gets
  ``pthrDelay``.
* ``KVB_BENCH_CONNECTOR_TIMES``: a directory. ``KVConnectorFactory.create_connector`` (the one place vLLM builds
  its KV connector, scheduler side and worker side, whatever the class) is wrapped so that the connector
  instance it returns has its per-step methods wrapped: wall time and calls are summed per method, per process
  and per thread (the outermost connector call only: a connector method calling another is counted once), and
  written to ``<dir>/<pid>.json`` every 0.5 s and at exit. The same wrapper times ``NixlConnector`` and
  ``KVBridgeConnector``.
* ``KVB_BENCH_READ_LOG``: a path prefix; kvbridge's read loop logs each read's phases (and how each prefill rank's
  part was trusted: pinned or checked) to ``<prefix>.<pid>``.
* ``KVB_BENCH_CONNECTOR_PROFILE`` (with ``KVB_BENCH_CONNECTOR_TIMES``): a comma-separated list of those methods
  (e.g. ``start_load_kv,get_finished``). Their outermost calls run under one cProfile profiler per process and
  thread, dumped to ``<dir>/<pid>.<thread>.prof`` every 2 s (from the profiled thread itself; read with
  ``pstats``). A profiled run's times are not results.
"""
import os
import sys

_READ_LOG = os.environ.get("KVB_BENCH_READ_LOG")
if _READ_LOG:  # every decode read's phases, one line each (kvbridge's debug log of the read loop)
    import logging

    _h = logging.FileHandler(f"{_READ_LOG}.{os.getpid()}")
    _h.setFormatter(logging.Formatter("%(created).6f %(message)s"))
    _lg = logging.getLogger("kvbridge.runtime.readloop")
    _lg.setLevel(logging.DEBUG)
    _lg.addHandler(_h)
    _lg.propagate = False

_delay = int(os.environ.get("KVB_BENCH_NIXL_PTHR_DELAY_US", "0"))
if _delay:
    try:
        import nixl_cu12._api as _api

        _real_agent = _api.nixlBind.nixlAgent

        def _agent(name, cfg, _real=_real_agent):
            cfg.pthrDelay = _delay
            return _real(name, cfg)

        _api.nixlBind.nixlAgent = _agent
    except ImportError:
        pass

_TIMES_DIR = os.environ.get("KVB_BENCH_CONNECTOR_TIMES")
_PROFILE = {m for m in os.environ.get("KVB_BENCH_CONNECTOR_PROFILE", "").split(",") if m}

# what vLLM calls on a connector per step or per request (scheduler side and worker side)
METHODS = (
    # scheduler side (engine core's thread)
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
    "request_finished_all_groups", "update_connector_output", "on_new_request", "get_finished_count",
    # worker side (the model runner's thread)
    "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
    "get_transfer_results", "get_block_ids_with_load_errors", "get_kv_connector_stats",
    "bind_connector_metadata", "clear_connector_metadata",
)

if _TIMES_DIR:
    import importlib.abc
    import importlib.util
    import json
    import threading
    import time

    _FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory"
    _lock = threading.Lock()
    _totals: dict = {}  # (thread name, role, method) -> [calls, seconds]
    _meta: dict = {"pid": os.getpid(), "connectors": []}
    _local = threading.local()

    def _dump() -> None:
        with _lock:
            rows = [[t, r, m, c, s] for (t, r, m), (c, s) in _totals.items()]
        data = dict(_meta, pgid=os.getpgid(0), time=time.time(), rows=rows)
        path = os.path.join(_TIMES_DIR, f"{os.getpid()}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)

    def _dumper() -> None:
        while True:
            time.sleep(0.5)
            try:
                _dump()
            except Exception:  # noqa: BLE001 - timing must never break the engine
                pass

    def _profiler():
        """This thread's profiler (cProfile profiles the thread that enables it)."""
        prof = getattr(_local, "prof", None)
        if prof is None:
            import cProfile
            prof = _local.prof = cProfile.Profile()
        return prof

    def _wrap(obj, role: str) -> None:
        for name in METHODS:
            fn = getattr(obj, name, None)
            if fn is None or not callable(fn):
                continue

            def timed(*a, _fn=fn, _name=name, **kw):
                if getattr(_local, "depth", 0):
                    return _fn(*a, **kw)
                _local.depth = 1
                prof = _profiler() if _name in _PROFILE else None
                t0 = time.perf_counter()
                try:
                    if prof is None:
                        return _fn(*a, **kw)
                    prof.enable()
                    try:
                        return _fn(*a, **kw)
                    finally:
                        prof.disable()
                finally:
                    dt = time.perf_counter() - t0
                    _local.depth = 0
                    if prof is not None and t0 - getattr(_local, "dumped", 0.0) > 2.0:
                        _local.dumped = t0
                        try:
                            prof.dump_stats(os.path.join(
                                _TIMES_DIR, f"{os.getpid()}.{threading.current_thread().name}.prof"))
                        except Exception:  # noqa: BLE001
                            pass
                    key = (threading.current_thread().name, role, _name)
                    with _lock:
                        v = _totals.setdefault(key, [0, 0.0])
                        v[0] += 1
                        v[1] += dt

            setattr(obj, name, timed)

    def _patch_factory(mod) -> None:
        cls = mod.KVConnectorFactory
        real = cls.create_connector.__func__

        def create_connector(klass, config, role, *a, **kw):
            conn = real(klass, config, role, *a, **kw)
            role_name = getattr(role, "name", str(role)).lower()
            _meta["connectors"].append([type(conn).__name__, role_name])
            _wrap(conn, role_name)
            if not _meta.get("dumper"):
                _meta["dumper"] = True
                threading.Thread(target=_dumper, name="kvb-bench-conn-times", daemon=True).start()
            return conn

        cls.create_connector = classmethod(create_connector)

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname != _FACTORY:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(fullname)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            loader = spec.loader
            real_exec = loader.exec_module

            def exec_module(module, _real=real_exec):
                _real(module)
                _patch_factory(module)

            loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())
    import atexit

    atexit.register(lambda: _meta.get("dumper") and _dump())
