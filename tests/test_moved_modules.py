"""Old import paths keep working (mpidist/__init__.py's finder): a module that moved imports
under its old name as the same module object, lazily (``import mpidist`` imports none of
them, nor mpi4py); ``python -m OLD_NAME`` runs the module; a module that was removed fails
with one line that says where its contents went.

The names are written out here, not read from the finder's table, so that dropping one from
the table fails a test.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap

import pytest

# Every module that moved (the layout change that made mpidist.core, and earlier moves):
# old name -> its module now.
MOVED = {
    "mpidist.buffers": "mpidist.core.buffers",
    "mpidist.collectives": "mpidist.core.collectives",
    "mpidist.comms": "mpidist.core.comms",
    "mpidist.devices": "mpidist.core.devices",
    "mpidist.mesh": "mpidist.core.mesh",
    "mpidist.topology": "mpidist.core.topology",
    "mpidist.kernels": "mpidist.optim.kernels",
    "mpidist.kernels.cpu": "mpidist.optim.kernels.cpu",
    "mpidist.kernels.cuda": "mpidist.optim.kernels.cuda",
    "mpidist.adapters": "mpidist.parallel.adapters",
    "mpidist.adapters.common": "mpidist.parallel.adapters.common",
    "mpidist.adapters.functional": "mpidist.parallel.adapters.functional",
    "mpidist.plan": "mpidist.parallel.plan",
    "mpidist.launch": "mpidist.run.launch",
    "mpidist.launch.env": "mpidist.run.launch.env",
    "mpidist.launch.guard": "mpidist.run.launch.guard",
    "mpidist.launch.supervisor": "mpidist.run.launch.supervisor",
    "mpidist.launch.log": "mpidist.run.logs",
    "mpidist.demo": "mpidist.cli.demo",
    "mpidist.tools_cli": "mpidist.cli.tools",
    "mpidist.train": "mpidist.cli.train",
}

# Every module that was removed: old name -> the module its error message sends the user to.
REMOVED = {
    "mpidist.adapters.torch": "mpidist.torch",
    "mpidist.launch.elastic_train": "mpidist.run.elastic",
    "mpidist.parallel.async_sgd": "mpidist.parallel.hooks",
    "mpidist.parallel.communication": "mpidist.parallel.codecs",
    "mpidist.parallel.ddp": "mpidist.parallel",
    "mpidist.parallel.hybrid": "mpidist.parallel",
    "mpidist.parallel.local_sgd": "mpidist.parallel.hooks",
    "mpidist.parallel.metered": "mpidist.parallel.hooks",
    "mpidist.parallel.zero": "mpidist.parallel",
}


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("old, new", MOVED.items(), ids=list(MOVED))
def test_old_name_is_the_same_module(old, new):
    module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert sys.modules[old] is module
    assert module.__name__ == new and module.__spec__.name == new  # its own spec, kept


def test_old_names_first_in_a_fresh_interpreter_are_lazy_and_single():
    """In a new process: ``import mpidist`` imports mpi4py and none of the moved modules it
    does not need itself; then each old name, imported before its new one, is the module
    that the new name gives, loaded once (no second copy under the old name)."""
    proc = _python(f"""
        import importlib, json, sys
        import mpidist
        out = {{"at_import": sorted(m for m in ["mpi4py", "mpidist.parallel.plan",
                                                "mpidist.cli", "mpidist.cli.train",
                                                "mpidist.run.launch.supervisor"]
                                   if m in sys.modules), "same": {{}}}}
        for old, new in {MOVED!r}.items():
            mod = importlib.import_module(old)
            out["same"][old] = mod is importlib.import_module(new) and mod.__name__ == new
        modules = {{id(m): m for m in list(sys.modules.values())}}.values()
        files = [m.__file__ for m in modules
                 if getattr(m, "__file__", None) and m.__name__.startswith("mpidist")]
        out["copies"] = len(files) - len(set(files))
        print(json.dumps(out))
    """)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["at_import"] == []
    assert out["same"] == dict.fromkeys(MOVED, True)
    assert out["copies"] == 0


def test_the_forms_users_wrote():
    """The old import statements of the docs and examples, as written then."""
    import mpidist.mesh as m
    from mpidist.buffers import ShardedLayout
    from mpidist.collectives import allreduce
    from mpidist.kernels import cpu
    from mpidist.launch import abort_on_failure
    from mpidist.topology import topology

    from mpidist import plan as planner
    from mpidist.core.collectives import allreduce as new_allreduce

    assert allreduce is new_allreduce
    assert m.ProcessMesh is importlib.import_module("mpidist").ProcessMesh
    assert ShardedLayout.__module__ == "mpidist.core.buffers"
    assert planner.__name__ == "mpidist.parallel.plan"
    assert cpu.__name__ == "mpidist.optim.kernels.cpu"
    assert abort_on_failure.__module__ == "mpidist.run.launch.guard"
    assert callable(topology)


@pytest.mark.parametrize("old, where", REMOVED.items(), ids=list(REMOVED))
def test_removed_module_fails_with_one_line_saying_where(old, where):
    with pytest.raises(ModuleNotFoundError) as info:
        importlib.import_module(old)
    text = str(info.value)
    assert "\n" not in text and old in text and "removed" in text
    assert where in text
    importlib.import_module(where)  # the place it names exists
    assert info.value.name == old


def test_unknown_names_still_fail_as_usual():
    for name in ("mpidist.no_such_module", "mpidist.kernels.no_such_module"):
        with pytest.raises(ModuleNotFoundError, match=f"No module named '{name}'$"):
            importlib.import_module(name)


@pytest.mark.parametrize("old, usage", [("mpidist.plan", "usage: mpidist plan"),
                                        ("mpidist.launch.supervisor", "usage: mpidist run")])
def test_python_m_old_name_runs_the_module(old, usage):
    proc = subprocess.run([sys.executable, "-m", old, "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(usage), proc.stdout
