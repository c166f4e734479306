"""perf.profile_round's arithmetic on made-up kernel timelines (CPU): which launches the GPU waits for, and the
kernel kinds of its per-stage sums."""
import pytest

from perf.profile_round import busy_and_gaps, idle_before, kernel_kind, replay_span_and_idle

pytestmark = pytest.mark.cpu


def test_idle_before_counts_only_time_with_no_kernel_running():
    replay = [("gemm", 0.0, 10.0), ("norm", 10.8, 12.0),     # 0.8 us idle before the norm
              ("attn", 11.5, 20.0),                          # launched early (PDL): overlaps, no idle
              ("gemm", 20.0, 30.0), ("norm", 31.0, 32.0)]    # 1.0 us idle
    second = [(name, start + 50.0, end + 50.0) for name, start, end in replay]  # 18 us of graph launch before it
    idle = idle_before(list(reversed(replay + second)), replays=2)  # any order
    assert idle == pytest.approx({"norm": 1.8})


def test_idle_before_measures_from_the_latest_end_of_overlapping_kernels():
    # a short kernel that ends inside a long one does not open a gap
    idle = idle_before([("long", 0.0, 100.0), ("short", 1.0, 2.0), ("next", 103.0, 110.0)], replays=1)
    assert idle == pytest.approx({"next": 3.0})


@pytest.mark.parametrize("name, kind", [("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", "GEMM"),
                                        ("sm90_xmma_gemm_bf16bf16_bf16f32", "GEMM"),
                                        ("_tree_attn_fwd", "attention"), ("_rmsnorm_kernel", "norm"),
                                        ("_all_reduce_rmsnorm_kernel", "all-reduce"), ("Memset (Unknown)", "copy"),
                                        ("_silu_mul_kernel", "other")])
def test_kernel_kind(name, kind):
    assert kernel_kind(name) == kind


def test_busy_and_gaps_counts_overlaps_once_and_splits_the_gaps():
    timeline = [("a", 0.0, 10.0), ("b", 5.0, 12.0),      # overlapping (PDL): 12 us busy, not 17
                ("c", 14.0, 20.0),                        # a 2 us gap
                ("d", 100.0, 101.0),                      # an 80 us gap: the host
                ("e", 100.5, 100.8)]                      # inside d
    span, busy, short, long = busy_and_gaps(list(reversed(timeline)))
    assert (span, busy, short, long) == pytest.approx((101.0, 19.0, 2.0, 80.0))
    assert busy_and_gaps([]) == (0.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("name", ["llama-gqa-untied", "q35-tp"])
def test_solo_shard_runs_rank0s_shapes_and_counts_the_collectives_it_skips(tmp_path, name):
    """--solo-width: the model sharded as rank 0 of width 2 would be, decoding on one device with no process group;
    a target forward skips an all-reduce after each layer's mixer and MLP, one after the embedding and the logits'
    gather, and the model prices them at --collective-us each."""
    import engine
    from correctness.checkpoints import make_hybrid_checkpoint, make_tiny_checkpoint
    from engine.parallel import head_ranges, shard_target
    from perf.profile_round import SoloShard, solo_model

    make = make_hybrid_checkpoint if name.startswith("q35") else make_tiny_checkpoint
    path, _ = make(tmp_path, name)
    full = engine.load_target(str(path)).model
    target = engine.load_target(str(path))
    solo = SoloShard(0, 2)
    shard_target(target.model, solo)
    cfg, model = full.cfg, target.model
    assert model.embed_tokens.weight.shape[0] == -(-cfg.vocab_size // 2)
    for layer, block in zip(full.layers, model.layers):
        assert next(block.mlp.parameters()).numel() < next(layer.mlp.parameters()).numel()
    q_lo, q_hi = head_ranges(cfg, 2, 0)[0]
    if hasattr(model.layers[-1], "self_attn"):
        assert model.layers[-1].self_attn.num_heads == q_hi - q_lo
    decoder = engine.Decoder(model, None, engine.DecodeSettings("ar"))
    report = solo_model(solo, lambda: decoder.generate([5, 7, 11], 1), collective_us=10.0)
    n = 2 * cfg.num_layers + 2
    assert solo.calls == n, (solo.calls, n)
    assert f"{n} in a target forward" in report and f"{n * 10.0 / 1e3:.2f} ms" in report
    out = decoder.generate([5, 7, 11], 6)
    assert len(out.tokens) == 6 and all(0 <= t < cfg.vocab_size for t in out.tokens)


def test_replay_span_and_idle_take_each_replay_alone():
    """The launch between replays is no replay's idle time; overlapping kernels count once; medians of the replays."""
    replay = [("gemm", 0.0, 10.0), ("norm", 10.8, 12.0), ("attn", 11.5, 20.0), ("gemm", 20.0, 30.0)]
    slow = [(name, start + 100.0, end + 100.0 + (5.0 if name == "attn" else 0.0)) for name, start, end in replay]
    late = [(name, start + 300.0 + (2.0 if start >= 20 else 0.0), end + 300.0 + (2.0 if start >= 20 else 0.0))
            for name, start, end in replay]                  # its last GEMM 2 us late: span 32, idle 2.8
    span, idle = replay_span_and_idle(list(reversed(replay + slow + late)), replays=3)
    assert span == pytest.approx(30.0) and idle == pytest.approx(0.8)
