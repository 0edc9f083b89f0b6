"""Floor 0: the error base under every deliberate error, and the environment read once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import atom_compile as ac
from atom_compile import envs, errors
from atom_compile.cache.store import PieceCache, cache_root, parse_index


@pytest.mark.parametrize("name, builtin", [
    ("ConfigError", ValueError), ("GraphBreakError", RuntimeError), ("BufferMutationError", RuntimeError),
    ("RecompileError", RuntimeError),
])
def test_public_errors_keep_their_builtin_base(name, builtin):
    cls = getattr(ac, name)
    assert issubclass(cls, ac.AtomCompileError) and issubclass(cls, builtin)


def test_errors_raised_on_bad_input_are_ours():
    with pytest.raises(ac.AtomCompileError, match="max_num_seqs"):
        ac.Config(max_num_seqs=0)
    with pytest.raises(ac.AtomCompileError, match="dims"):
        @ac.support_torch_compile
        class NoTensors(torch.nn.Module):
            def forward(self, n: int) -> int:
                return n
    with pytest.raises(errors.IndexInvalid) as info:
        parse_index("{not json")
    assert isinstance(info.value, (ValueError, ac.AtomCompileError))
    with pytest.raises(ValueError, match="16 hex digits"):
        PieceCache(Path("/tmp"), "nothex", 0, "p")


def test_environment_is_read_into_one_object(monkeypatch, tmp_path):
    monkeypatch.setenv("ATOM_COMPILE_CACHE_ROOT", str(tmp_path / "root"))
    monkeypatch.setenv("ATOM_COMPILE_CHECK_INPUTS", "0")
    env = envs.read()
    assert env.cache_root == tmp_path / "root" and not env.cache_disabled and env.check_inputs is False
    assert envs.read(str(tmp_path / "mine")).cache_root == tmp_path / "mine"  # the config's cache_dir wins
    assert cache_root() == tmp_path / "root" and cache_root(str(tmp_path / "x")) == tmp_path / "x"
    monkeypatch.setenv("ATOM_COMPILE_DISABLE_CACHE", "1")
    assert envs.read().cache_disabled and envs.read().cache_root is None
    monkeypatch.delenv("ATOM_COMPILE_CACHE_ROOT")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "atom"


def test_the_backend_keeps_the_environment_it_was_built_with(monkeypatch, tmp_path):
    monkeypatch.setenv("ATOM_COMPILE_CACHE_ROOT", str(tmp_path / "first"))
    b = ac.backend(ac.CompilationConfig(level=2))
    monkeypatch.setenv("ATOM_COMPILE_CACHE_ROOT", str(tmp_path / "second"))
    assert b.environment.cache_root == tmp_path / "first"
    assert ac.backend(ac.CompilationConfig(level=2, cache_dir=str(tmp_path / "cfg"))).environment.cache_root \
        == tmp_path / "cfg"


def test_peer_timeout_is_read_once_and_checked(monkeypatch):
    monkeypatch.delenv("ATOM_COMPILE_PEER_TIMEOUT", raising=False)
    assert envs.read().peer_timeout == 600.0
    monkeypatch.setenv("ATOM_COMPILE_PEER_TIMEOUT", "2.5")
    assert envs.read().peer_timeout == 2.5
    for bad in ("soon", "0", "-3"):
        monkeypatch.setenv("ATOM_COMPILE_PEER_TIMEOUT", bad)
        with pytest.raises(ac.AtomCompileError, match=f"ATOM_COMPILE_PEER_TIMEOUT: got '{bad}'"):
            envs.read()


def test_group_owners_auto_or_a_positive_count(monkeypatch):
    monkeypatch.delenv("ATOM_COMPILE_GROUP_OWNERS", raising=False)
    assert envs.read().group_owners is None
    for raw, value in (("auto", None), (" AUTO ", None), ("1", 1), ("8", 8)):
        monkeypatch.setenv("ATOM_COMPILE_GROUP_OWNERS", raw)
        assert envs.read().group_owners == value
    for bad in ("0", "-2", "two", "1.5"):
        monkeypatch.setenv("ATOM_COMPILE_GROUP_OWNERS", bad)
        with pytest.raises(ac.AtomCompileError, match="ATOM_COMPILE_GROUP_OWNERS: got .*allowed: 'auto'"):
            envs.read()


def test_group_compile_switch_and_group_type(monkeypatch):
    from atom_compile import groups

    monkeypatch.delenv("ATOM_COMPILE_GROUP_COMPILE", raising=False)
    assert envs.read().group_compile is True
    monkeypatch.setenv("ATOM_COMPILE_GROUP_COMPILE", "0")
    assert envs.read().group_compile is False
    assert groups.compile_group() is None  # torch.distributed not initialised: the locks only
    with pytest.raises(ac.AtomCompileError, match="set_compile_group: got str"):
        groups.set_compile_group("world")
    groups.set_compile_group(None)


def test_split_k_switch_is_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv("ATOM_COMPILE_SPLIT_K", raising=False)
    assert envs.split_k_rows() is True
    for value, on in (("1", True), ("true", True), ("0", False), ("off", False), ("no", False), ("", True)):
        monkeypatch.setenv("ATOM_COMPILE_SPLIT_K", value)
        assert envs.split_k_rows() is on, value


def test_prefetch_is_off_all_or_a_list_of_kinds(monkeypatch):
    monkeypatch.delenv("ATOM_COMPILE_PREFETCH", raising=False)
    assert not envs.prefetch() and not envs.prefetch("linear") and not envs.prefetch("attention")
    for raw, linear, attention in (("1", True, True), ("all", True, True), ("0", False, False),
                                   ("attention", False, True), (" Linear ", True, False),
                                   ("attention,linear", True, True)):
        monkeypatch.setenv("ATOM_COMPILE_PREFETCH", raw)
        assert (envs.prefetch("linear"), envs.prefetch("attention")) == (linear, attention), raw
        assert envs.prefetch() is (linear or attention), raw
        envs.read()
    for bad in ("attn", "linear,norm", "2"):
        monkeypatch.setenv("ATOM_COMPILE_PREFETCH", bad)
        with pytest.raises(ac.AtomCompileError, match="ATOM_COMPILE_PREFETCH: got .*allowed: 0, 1, or a comma list"):
            envs.read()
