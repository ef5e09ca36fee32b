"""Blends of token files: the syntax, the sources drawn in proportion to the weights (a
stated tolerance over many steps), the batches a pure function of (seed, step) and the
same for every data-parallel slicing, reading each window from its source, the recorded
identity, and the settings around a blend."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from token_helpers import write_megatron

from mpidist.data.blend import (
    BlendSampler,
    blend_hash,
    blend_sources,
    normalized,
    open_blend,
    parse_blend,
)
from mpidist.data.prepare import prepare
from mpidist.data.sampler import WindowSampler, split_points
from mpidist.data.textfiles import entropy
from mpidist.run.config import TrainConfig, load_toml

LETTERS = "".join(chr(ord("a") + i % 26) for i in range(997))
DIGITS = "".join(str(i % 10) for i in range(1013))


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two token files of the bytes tokenizer: one of letters only, one of digits only, in
    documents (so every window says which file it came from); names with ':' and ','."""
    root = tmp_path_factory.mktemp("blend")
    out = {}
    for name, text in (("letters:a,b.h5", LETTERS), ("digits,1:2.h5", DIGITS)):
        src = root / (name + ".txt")
        src.write_text("\n\n".join(text[i:] + text[:i] for i in range(0, 600, 7)),
                       encoding="utf-8")
        prepare([str(src)], str(root / name), "bytes", separator="\n\n")
        out[name.split(":")[0].split(",")[0]] = root / name
    return out


# -- the syntax ------------------------------------------------------------------------------
def test_the_blend_is_weight_path_pairs_in_every_form():
    want = [[0.7, "a:x,y.h5"], [0.3, "dir,1/b:2"]]
    assert parse_blend(["0.7", "a:x,y.h5", "0.3", "dir,1/b:2"]) == want
    assert parse_blend([{"path": "a:x,y.h5", "weight": 0.7},
                        {"weight": 0.3, "path": "dir,1/b:2"}]) == want
    assert parse_blend([[0.7, "a:x,y.h5"], [0.3, "dir,1/b:2"]]) == want
    assert parse_blend(want) == want  # the canonical form parses to itself
    assert parse_blend([7, "a", 3, "b"]) == [[7.0, "a"], [3.0, "b"]]


@pytest.mark.parametrize("spec, message", [
    (["0.7", "a.h5", "0.3"], "--data-blend 0.7 a.h5 0.3: needs WEIGHT PATH pairs (3 words "
                             "given)"),
    (["a.h5", "0.7"], "--data-blend (source 1): weight 'a.h5' is not a number (the blend is "
                      "WEIGHT PATH WEIGHT PATH ...)"),
    (["0", "a.h5"], "--data-blend (source 1): weight '0' must be a positive number"),
    (["-1", "a.h5"], "--data-blend (source 1): weight '-1' must be a positive number"),
    (["nan", "a.h5"], "--data-blend (source 1): weight 'nan' must be a positive number"),
    (["1", "a.h5", "2", "a.h5"], "--data-blend: a.h5 is named more than once"),
    ([{"path": "a.h5"}], "--data-blend[0]={'path': 'a.h5'} must be a table with path and "
                         "weight only"),
    ([{"path": "a.h5", "weight": 1, "w": 2}], "--data-blend[0]={'path': 'a.h5', 'weight': "
                                              "1, 'w': 2} must be a table with path and "
                                              "weight only (unknown: ['w'])"),
    ([], "--data-blend=[] must be a non-empty list of weights and paths"),
])
def test_a_bad_blend_is_one_line_naming_it(spec, message):
    with pytest.raises(ValueError) as err:
        parse_blend(spec)
    assert str(err.value) == message


# -- the proportions -----------------------------------------------------------------------
WEIGHTS = [[0.7, 0.3], [0.5, 0.3, 0.2], [0.01, 0.99], [1, 1, 1], [5, 1, 1, 1, 1, 1],
           [0.123, 0.456, 0.421]]


@pytest.mark.parametrize("weights", WEIGHTS)
def test_sources_follow_the_weights_within_five_samples(weights):
    """Stated tolerance: in the first N samples, for every N up to 200,000 (6,250 steps of
    32), every source's count is within 5 samples of w * N; so over S steps of B samples
    the share of each source is w within 5 / (S * B)."""
    shares = normalized(weights)
    n = 200_000
    src = blend_sources(np.arange(n), shares)
    prefix = np.cumsum(np.eye(len(shares), dtype=np.int64)[src], axis=0)
    expected = np.outer(np.arange(1, n + 1), shares)
    assert np.abs(prefix - expected).max() <= 5
    # each batch of 32 holds every source in proportion, up to a few samples
    per_step = prefix[31::32] - np.vstack([np.zeros(len(shares)), prefix[31:-1:32]])
    assert np.abs(per_step - 32 * shares).max() <= 6


def test_the_assignment_is_fixed_and_independent_of_the_seed():
    a = BlendSampler([100, 50], [0.6, 0.4], 32, seed=1)
    b = BlendSampler([100, 50], [0.6, 0.4], 32, seed=2)
    for step in (0, 1, 17, 10**9):
        assert np.array_equal(a.sources(step), b.sources(step))
        assert np.array_equal(a.sources(step),
                              blend_sources(np.arange(step * 32, step * 32 + 32),
                                            normalized([0.6, 0.4])))


# -- the sampler -----------------------------------------------------------------------------
def test_a_blend_batch_is_a_pure_function_of_seed_and_step():
    sizes, weights = [1000, 37, 5000], [0.2, 0.3, 0.5]
    s1 = BlendSampler(sizes, normalized(weights), 12, seed=4)
    s2 = BlendSampler(sizes, normalized(weights), 12, seed=4)
    for step in (5, 0, 3, 5):  # any order, any number of times
        g = s1.global_indices(step)
        assert np.array_equal(g, s2.global_indices(step))
        src = np.searchsorted(s1.offsets, g, side="right") - 1
        assert np.array_equal(src, s1.sources(step))
        for dp in (1, 2, 3, 5):
            cuts = split_points(12, dp)
            parts = [s1.local_indices(step, r, dp) for r in range(dp)]
            assert [len(p) for p in parts] == np.diff(cuts).tolist()
            assert np.array_equal(np.concatenate(parts), g)
    assert not np.array_equal(s1.global_indices(1), BlendSampler(
        sizes, normalized(weights), 12, seed=5).global_indices(1))


def test_a_blend_of_one_source_draws_what_the_file_alone_draws():
    one = BlendSampler([777], [1.0], 16, seed=9)
    alone = WindowSampler(777, 16, seed=9)
    for step in range(5):
        assert np.array_equal(one.global_indices(step), alone.global_indices(step))


def test_a_resume_takes_the_step_and_reweight_takes_it_from_another_blend():
    old = BlendSampler([100, 50], [0.6, 0.4], 8, seed=1)
    old.step = 7
    new = BlendSampler([100, 60, 10], [0.2, 0.4, 0.4], 8, seed=1)
    with pytest.raises(ValueError, match="sampler state has n_samples=150 but this sampler "
                                         "has n_samples=170"):
        new.load_state_dict(old.state_dict())
    new.reweight = True
    new.load_state_dict(old.state_dict())
    assert new.step == 7


# -- reading a blend -------------------------------------------------------------------------
def test_every_window_comes_from_its_source_in_proportion(sources):
    train, valid = open_blend([[3, str(sources["letters"])], [1, str(sources["digits"])]], 8)
    sampler = train.sampler(20, seed=3)
    letters = 0
    for step in range(60):
        idx = sampler.global_indices(step)
        x, y = train.batch(idx)
        src = sampler.sources(step)
        for row, s in zip(np.concatenate([x, y[:, -1:]], axis=1), src, strict=True):
            text = bytes(int(v) for v in row if v != 256).decode()
            assert (text.isalpha() if s == 0 else text.isdigit()), (s, text)
        letters += int((src == 0).sum())
    assert abs(letters - 0.75 * 60 * 20) <= 5
    x, _ = valid.batch(valid.eval_sampler(20, seed=1).global_indices(0))
    assert x.shape == (20, 8)
    assert math.isclose(sum(valid.shares), 1.0) and valid.shares.tolist() == [0.75, 0.25]


def test_the_identity_names_the_sources_and_the_normalized_weights(sources):
    a, b = str(sources["letters"]), str(sources["digits"])
    train, _ = open_blend([[0.7, a], [0.3, b]], 8)
    ident = train.identity()
    assert ident["kind"] == "blend" and ident["tokenizer"]["name"] == "bytes"
    assert [(s["path"], s["weight"], s["share"], s["kind"]) for s in ident["sources"]] == [
        (a, 0.7, 0.7, "tokens"), (b, 0.3, 0.3, "tokens")]
    assert ident["hash"] == blend_hash(ident["sources"])
    same, _ = open_blend([[7, a], [3, b]], 8)  # the same proportions
    assert same.identity()["hash"] == ident["hash"]
    for other in ([[0.6, a], [0.4, b]], [[0.3, b], [0.7, a]], [[1, a]]):
        assert open_blend(other, 8)[0].identity()["hash"] != ident["hash"]


def test_the_unigram_baseline_of_a_blend_is_that_of_the_weighted_frequencies(sources):
    a, b = str(sources["letters"]), str(sources["digits"])
    train, _ = open_blend([[0.25, a], [0.75, b]], 8)
    ca, cb = (d.split_counts().astype(float) for d in train.datasets)
    mix = 0.25 * ca / ca.sum() + 0.75 * cb / cb.sum()
    p = mix[mix > 0]
    assert math.isclose(train.unigram_baseline(), float(-(p * np.log(p)).sum()),
                        rel_tol=1e-12)
    assert math.isclose(train.unigram_baseline(), entropy(mix), rel_tol=1e-12)


def test_megatron_files_blend_with_token_files_of_the_same_vocabulary(sources, tmp_path):
    prefix = tmp_path / "meg"
    ids = np.frombuffer(DIGITS.encode(), dtype=np.uint8)
    write_megatron(prefix, [[ids[i:i + 300]] for i in range(0, 900, 100)])
    cfg = TrainConfig(out=str(tmp_path / "run"), data_blend=[
        "0.5", str(sources["letters"]), "0.5", str(prefix)], block_size=8)
    assert cfg.data_vocab() == 257  # the token file's tokenizer
    train, valid = open_blend(cfg.data_blend, 8)
    kinds = [s["kind"] for s in train.identity()["sources"]]
    assert kinds == ["tokens", "megatron"] and len(valid.datasets) == 2
    with pytest.raises(ValueError, match="names no tokenizer: give its vocabulary with "
                                         "--vocab-size"):
        TrainConfig(out=str(tmp_path / "run"), data_blend=["1", str(prefix)])


# -- settings --------------------------------------------------------------------------------
def test_blend_settings_from_flags_and_toml(sources, tmp_path):
    a, b = str(sources["letters"]), str(sources["digits"])
    cfg = TrainConfig.from_sources({}, {"data_blend": ["2", a, "1", b]})
    assert cfg.data_blend == [[2.0, a], [1.0, b]] and cfg.data is None
    toml = tmp_path / "run.toml"
    toml.write_text(f'[train]\ndata = [{{path = "{a}", weight = 2}}, '
                    f'{{path = "{b}", weight = 1}}]\nsteps = 3\n')
    from_file = TrainConfig.from_sources(load_toml(str(toml)), {})
    assert from_file.data_blend == cfg.data_blend and from_file.steps == 3
    flat = TrainConfig.from_sources({"data_blend": [2, a, 1, b]}, {})
    assert flat.data_blend == cfg.data_blend
    # a flag on the command line replaces the file's data, blend or not
    assert TrainConfig.from_sources(load_toml(str(toml)), {"data": a}).data_blend is None


@pytest.mark.parametrize("case, message", [
    ("both", "--data {a} and --data-blend both given: give one (a blend of one file is "
             "--data-blend 1 PATH)"),
    ("text", "--data-blend {txt}: text, not a token file (a blend takes token files; "
             "mpidist prepare {txt} --out FILE --tokenizer bytes|bpe:V|tokenizer.json makes "
             "one)"),
    ("tokenizers", "--data-blend: {other} and {a} were made with different tokenizers"),
    ("val_bytes", "--val-bytes names the bytes of one validation file: with --data-blend "
                  "it needs --val-data"),
    ("binary", "--data-binary applies to text; --data-blend takes token files"),
])
def test_bad_blend_settings_are_one_line(sources, tmp_path, case, message):
    pytest.importorskip("tokenizers")
    a, b = str(sources["letters"]), str(sources["digits"])
    txt = tmp_path / "plain.txt"
    txt.write_text("some text\n" * 50)
    other = tmp_path / "other.h5"
    kwargs: dict = {"data_blend": ["1", a, "1", b]}
    if case == "both":
        kwargs["data"] = a
    elif case == "text":
        kwargs["data_blend"] = ["1", a, "1", str(txt)]
    elif case == "tokenizers":
        prepare([str(txt)], str(other), "bpe:260")
        kwargs["data_blend"] = ["1", a, "1", str(other)]
    elif case == "val_bytes":
        kwargs["val_bytes"] = 100
    else:
        kwargs["data_binary"] = True
    with pytest.raises(ValueError) as err:
        TrainConfig(out=str(tmp_path / "run"), **kwargs)
    assert str(err.value) == message.format(a=a, txt=txt, other=other)
