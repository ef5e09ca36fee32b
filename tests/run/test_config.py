"""The settings of `mpidist train`: TOML types, help texts, the output directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mpidist.cli import build_parser
from mpidist.run.config import TrainConfig, check_output_directory, load_toml


def test_every_train_flag_has_a_help_text_with_its_default():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    train = sub.choices["train"]
    missing = [a.option_strings[0] for a in train._actions
               if a.option_strings and a.dest != "help"
               and (not a.help or "default" not in a.help)]
    assert not missing, missing


def test_every_setting_has_a_flag():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    dests = {a.dest for a in sub.choices["train"]._actions}
    from dataclasses import fields

    assert {f.name for f in fields(TrainConfig)} <= dests


@pytest.mark.parametrize("text, message", [
    ('steps = "ten"', "config file key steps='ten' must be of type int"),
    ("lr = true", "config file key lr=True must be of type float"),
    ("resume = 1", "config file key resume=1 must be of type bool"),
    ("strategy = 3", "config file key strategy=3 must be of type str"),
    ("global-batch = 1.5", "config file key global_batch=1.5 must be of type int"),
])
def test_toml_value_of_the_wrong_type_names_its_key(tmp_path: Path, text: str, message: str):
    path = tmp_path / "run.toml"
    path.write_text(f"[train]\n{text}\n")
    with pytest.raises(ValueError) as exc:
        TrainConfig.from_sources(load_toml(str(path)), {})
    assert message in str(exc.value)


def test_toml_accepts_an_int_for_a_float_and_flags_override(tmp_path: Path):
    path = tmp_path / "run.toml"
    path.write_text('lr = 1\nstrategy = "localsgd"\nsync-period = 4\n')
    cfg = TrainConfig.from_sources(load_toml(str(path)), {"sync_period": 2, "steps": None})
    assert cfg.lr == 1 and cfg.strategy == "localsgd" and cfg.sync_period == 2


@pytest.mark.parametrize("kwargs, message", [
    ({"compression": "zip"}, "compression='zip' is not one of"),
    ({"topk_ratio": 0.0}, "topk_ratio=0.0 must be in (0, 1]"),
    ({"hang_timeout": -1.0}, "hang_timeout=-1.0 must be >= 0 seconds (0: no timeout)"),
    ({"staleness": -1}, "staleness=-1 must be an integer >= 0"),
    ({"zero_stage": 4}, "zero_stage=4 must be 0, 1, 2 or 3"),
    ({"data": "/nonexistent/corpus"}, "data='/nonexistent/corpus': no such file"),
])
def test_bad_settings_name_the_value(kwargs, message):
    with pytest.raises(ValueError) as exc:
        TrainConfig(**kwargs)
    assert message in str(exc.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_out_is_a_clear_error(tmp_path: Path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="cannot be created"):
            check_output_directory(str(locked / "run"))
        with pytest.raises(ValueError, match="is not writable"):
            check_output_directory(str(locked))
    finally:
        locked.chmod(0o700)


def test_out_that_is_a_file_is_a_clear_error(tmp_path: Path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        check_output_directory(str(path))
    with pytest.raises(ValueError, match="cannot be created"):
        check_output_directory(str(path / "sub"))
    check_output_directory(str(tmp_path / "new" / "deeper"))  # creatable: fine


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_out_that_cannot_be_created_is_a_clear_error_not_a_traceback():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "mpidist.cli", "train", "--out",
                           "/proc/self/mpidist-run", "--steps", "1", "--no-progress"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "mpidist train: error: --out '/proc/self/mpidist-run'" in proc.stderr
    assert "Traceback" not in proc.stderr
