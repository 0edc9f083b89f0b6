import json

import pytest

from atom_compile import CompilationConfig, CompilationLevel, Config, ConfigError, CUDAGraphMode
from atom_compile.config import default_capture_ladder, normalize_op_name


def test_levels_parse_numbers_names_and_vllm_modes():
    assert CompilationLevel.parse(3) is CompilationLevel.PIECEWISE
    assert CompilationLevel.parse("dynamo_once") is CompilationLevel.DYNAMO_ONCE
    assert CompilationLevel.parse("VLLM_COMPILE") is CompilationLevel.PIECEWISE
    assert CompilationLevel.parse("1") is CompilationLevel.DYNAMO_AS_IS


@pytest.mark.parametrize("name, mode", [
    ("none", CUDAGraphMode.NONE), ("Tr_Hybrid", CUDAGraphMode.TR_HYBRID), ("piecewise", CUDAGraphMode.TR_HYBRID),
    ("FULL", CUDAGraphMode.FULL), ("full_decode_only", CUDAGraphMode.FULL_DECODE_ONLY),
    ("FULL_AND_PIECEWISE", CUDAGraphMode.FULL_AND_TR_HYBRID), (2, CUDAGraphMode.FULL),
    ([2, 0], CUDAGraphMode.FULL_DECODE_ONLY), ((2, 1), CUDAGraphMode.FULL_AND_TR_HYBRID),
])
def test_cudagraph_mode_parse(name, mode):
    assert CUDAGraphMode.parse(name) is mode


def test_cudagraph_mode_helpers():
    m = CUDAGraphMode
    assert m.FULL_DECODE_ONLY.value == (2, 0) and m.FULL_AND_TR_HYBRID.value == (2, 1)
    assert m.FULL_DECODE_ONLY.decode_mode() is m.FULL and m.FULL_DECODE_ONLY.mixed_mode() is m.NONE
    assert m.FULL_AND_TR_HYBRID.mixed_mode() is m.TR_HYBRID
    assert m.TR_HYBRID.decode_mode() is m.TR_HYBRID and m.TR_HYBRID.mixed_mode() is m.TR_HYBRID
    assert [x.separate_routine() for x in m] == [False, False, False, True, True]
    assert [x.has_full_cudagraphs() for x in m] == [False, False, True, True, True]
    assert [x.uses_tr_hybrid() for x in m] == [False, True, False, False, True]
    assert [x.max_cudagraph_mode() for x in m] == [m.NONE, m.TR_HYBRID, m.FULL, m.FULL, m.FULL]


def test_capture_ladder_from_cuda_graph_sizes():
    assert default_capture_ladder(64) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 48, 64]
    cfg = Config(compilation_config=CompilationConfig(level=3))
    assert cfg.capture_sizes[:9] == [1, 2, 3, 4, 5, 6, 7, 8, 16] and cfg.capture_sizes[-1] == 512
    assert len(cfg.capture_sizes) == 40
    # the generated ladder stops at max_num_seqs
    assert Config(max_num_seqs=20).capture_sizes == [1, 2, 3, 4, 5, 6, 7, 8, 16]
    # more than one value is used as given; explicit capture sizes win
    assert Config(compilation_config=CompilationConfig(cuda_graph_sizes=[4, 1, 2])).capture_sizes == [1, 2, 4]
    cc = CompilationConfig(cudagraph_capture_sizes=[8, 2], cuda_graph_sizes=[64])
    assert Config(compilation_config=cc).capture_sizes == [2, 8]
    assert Config(compilation_config=CompilationConfig(use_cudagraph=False)).capture_sizes == []


def test_level3_setup_sequence():
    cfg = Config(compilation_config=CompilationConfig(level=3, compile_sizes=["cudagraph_capture_sizes", 100],
                                                      cudagraph_capture_sizes=[1, 4]))
    cc = cfg.compilation_config
    assert cc.splitting_ops == ["aiter::unified_attention_with_output", "aiter::mla_attention"]
    assert cc.cudagraph_mode is CUDAGraphMode.TR_HYBRID
    assert cc.compile_sizes == [1, 4, 100]
    # a chosen mode and an explicit empty split list are kept
    cfg = Config(compilation_config=CompilationConfig(level=3, splitting_ops=[], cudagraph_mode="FULL"))
    assert cfg.compilation_config.splitting_ops == [] and cfg.compilation_config.cudagraph_mode is CUDAGraphMode.FULL
    assert Config(compilation_config=CompilationConfig(level=2)).compilation_config.cudagraph_mode is CUDAGraphMode.NONE


def test_from_dict_json_and_vllm_keys():
    cc = CompilationConfig.from_dict('{"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE", "backend": "eager"}')
    assert cc.level is CompilationLevel.PIECEWISE and cc.cudagraph_mode is CUDAGraphMode.FULL_AND_TR_HYBRID
    assert cc.compiler == "eager"
    assert CompilationConfig.from_dict(2).level is CompilationLevel.DYNAMO_ONCE
    again = CompilationConfig.from_dict(json.loads(json.dumps(cc.to_dict())))
    assert again.to_dict() == cc.to_dict()
    cfg = Config.from_dict({"max_num_seqs": 16, "compilation_config": {"level": 3, "cuda_graph_sizes": [16]}})
    assert cfg.capture_sizes[-1] == 16


def test_hash_covers_compile_fields_only():
    base = CompilationConfig(level=3, compile_sizes=[4])
    assert base.compute_hash() == CompilationConfig(level=3, compile_sizes=[4]).compute_hash()
    for other in (CompilationConfig(level=2, compile_sizes=[4]), CompilationConfig(level=3, compile_sizes=[8]),
                  CompilationConfig(level=3, compile_sizes=[4], inductor_compile_config={"max_autotune": True}),
                  CompilationConfig(level=3, compile_sizes=[4], compiler="eager"),
                  CompilationConfig(level=3, compile_sizes=[4], splitting_ops=["silly.attention"])):
        assert other.compute_hash() != base.compute_hash()
    for same in (CompilationConfig(level=3, compile_sizes=[4], cache_dir="/elsewhere"),
                 CompilationConfig(level=3, compile_sizes=[4], debug_dump_path="/tmp/x"),
                 CompilationConfig(level=3, compile_sizes=[4], cudagraph_mode="FULL", cudagraph_capture_sizes=[1])):
        assert same.compute_hash() == base.compute_hash()


@pytest.mark.parametrize("kwargs, field", [
    ({"level": 7}, "CompilationConfig.level"),
    ({"level": "fast"}, "CompilationConfig.level"),
    ({"level": True}, "CompilationConfig.level"),
    ({"cudagraph_mode": "SOMETIMES"}, "CompilationConfig.cudagraph_mode"),
    ({"cudagraph_mode": 5}, "CompilationConfig.cudagraph_mode"),
    ({"cudagraph_capture_sizes": [0]}, "CompilationConfig.cudagraph_capture_sizes"),
    ({"cudagraph_capture_sizes": [-4]}, "CompilationConfig.cudagraph_capture_sizes"),
    ({"cudagraph_capture_sizes": [2.5]}, "CompilationConfig.cudagraph_capture_sizes"),
    ({"cudagraph_capture_sizes": "8"}, "CompilationConfig.cudagraph_capture_sizes"),
    ({"cuda_graph_sizes": []}, "CompilationConfig.cuda_graph_sizes"),
    ({"compile_sizes": [4, "all"]}, "CompilationConfig.compile_sizes"),
    ({"compile_sizes": [0]}, "CompilationConfig.compile_sizes"),
    ({"compiler": "tvm"}, "CompilationConfig.compiler"),
    ({"splitting_ops": ["attention"]}, "CompilationConfig.splitting_ops"),
    ({"splitting_ops": ["aiter::a::b"]}, "CompilationConfig.splitting_ops"),
    ({"splitting_ops": "aiter.attn"}, "CompilationConfig.splitting_ops"),
    ({"use_inductor": "yes"}, "CompilationConfig.use_inductor"),
    ({"use_inductor": False, "compiler": "inductor"}, "CompilationConfig.compiler"),
    ({"inductor_compile_config": [("a", 1)]}, "CompilationConfig.inductor_compile_config"),
])
def test_validation_names_field_value_and_allowed(kwargs, field):
    with pytest.raises(ConfigError) as info:
        CompilationConfig(**kwargs)
    message = str(info.value)
    assert message.startswith(field) and "allowed" in message
    assert isinstance(info.value, ValueError)


def test_config_validation():
    with pytest.raises(ConfigError, match=r"cudagraph_capture_sizes: got 64; allowed: a positive int <= max_num_seqs \(32\)"):
        Config(max_num_seqs=32, compilation_config=CompilationConfig(cudagraph_capture_sizes=[1, 64]))
    with pytest.raises(ConfigError, match="Config.max_num_seqs"):
        Config(max_num_seqs=0)
    with pytest.raises(ConfigError, match="Config.num_draft_tokens"):
        Config(num_draft_tokens=-1)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        Config(max_num_batched_tokens=64, compilation_config=CompilationConfig(compile_sizes=[128]))
    with pytest.raises(ConfigError, match="compilation_config: got 'bogus'"):
        CompilationConfig.from_dict({"bogus": 1})
    with pytest.raises(ConfigError, match="a JSON object"):
        CompilationConfig.from_dict("{level: 3")
    with pytest.raises(ConfigError, match="mode"):
        CompilationConfig.from_dict({"mode": 2, "level": 3})


def test_draft_tokens_rows_fit_the_token_budget():
    cfg = Config(num_draft_tokens=1, max_num_seqs=8, compilation_config=CompilationConfig(cudagraph_capture_sizes=[8]))
    assert cfg.max_q_len == 2
    with pytest.raises(ConfigError, match="rows"):
        Config(num_draft_tokens=3, max_num_seqs=8, max_num_batched_tokens=16,
               compilation_config=CompilationConfig(cudagraph_capture_sizes=[8]))


def test_op_names_normalise():
    assert normalize_op_name("aiter.unified_attention_with_output") == "aiter::unified_attention_with_output"
    assert normalize_op_name("silly::attention.default") == "silly::attention.default"
