"""`tformer plan`: its memory prediction against memory measured on this CPU, and its formulas."""
import pytest
import torch

from tformer import build_model
from tformer.parallel.memory import SavedActivations, model_state_bytes
from tformer.parallel.plan import activation_bytes, estimate, model_state_bytes as formula, parse_bytes


def _measure(model, batch, ac):
    from tformer.parallel.ac import apply_activation_checkpointing
    apply_activation_checkpointing(model, ac)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with SavedActivations() as saved:
        loss = model(**batch).loss
    loss.backward()
    opt.step()
    return model_state_bytes(model, opt), saved.bytes


@pytest.mark.parametrize("name,ac", [("gpt2-tiny", "none"), ("gpt2-tiny", "full"), ("llama-tiny", "none"),
                                     ("t5-tiny", "none"), ("bert-tiny", "full")])
def test_prediction_within_25_percent_of_measured_memory(name, ac):
    """fp32, one process: model states (params + grads + Adam) + saved activations + logits."""
    extra = {"num_decoder_layers": 4} if "t5" in name else {}
    model = build_model(name, d_model=128, num_layers=4, d_ff=512, vocab_size=1024, dropout=0.0,
                        **({"d_head": 32} if "t5" in name else {}), **extra).train()
    b, s, t = 4, 128, 32
    ids = torch.randint(3, 1000, (b, s))
    batch = {"input_ids": ids, "labels": ids if model.config.family != "encdec" else ids[:, :t]}
    states, activations = _measure(model, batch, ac)
    target = t if model.config.family == "encdec" else None
    e = estimate(model.config, "ddp", 1, b, s, target, ac, mixed=False)
    assert e.model_states == pytest.approx(states, rel=0.02)  # model states are exact
    # what is held between forward and backward: model states + the activations autograd saved
    kept = e.model_states + activation_bytes(model.config, b, s, target, ac, False, transient=False)
    assert kept == pytest.approx(states + activations, rel=0.25), (kept, states + activations)
    assert e.total > kept  # the peak adds the recomputed block / logits gradient on top


def test_zero_formulas_and_the_planner_choice():
    p, n = 1_000_000, 4
    assert formula("ddp", p, n, mixed=True) == 16 * p
    assert formula("zero1", p, n, mixed=True) == 4 * p + 12 * p / n
    assert formula("zero2", p, n, mixed=True) == 2 * p + 14 * p / n
    assert formula("zero3", p, n, mixed=True) == 16 * p / n
    assert formula("zero2", p, n, mixed=False) == 4 * p + 12 * p / n
    # what the planner predicts for fp32 DeepSpeed: its fp32 master copy of the partition
    assert formula("zero3", p, n, mixed=False, as_built=True) == 20 * p / n
    assert formula("zero2", p, n, mixed=False, as_built=True) == 4 * p + 16 * p / n
    tiny = build_model("gpt2-tiny")
    assert estimate(tiny.config, "zero3", n, 1, 64, mixed=False).model_states == 20 * tiny.num_parameters() / n
    with torch.device("meta"):
        cfg = build_model("llama-1b").config
    # A 1.2B model does not fit plain DDP on 16 GiB with Adam; the planner must shard
    from tformer.parallel.plan import recommend
    fits = recommend(cfg, 8, 16 * 2**30, 2048, None)
    assert fits and fits[0].strategy != "ddp"
    assert all(f.total <= 0.9 * 16 * 2**30 for f in fits)
    with torch.device("meta"):
        deep = build_model("gpt2-xl").config  # 48 layers: block activations dominate the logits
    assert activation_bytes(deep, 1, 1024, None, "full", True) < 0.5 * activation_bytes(deep, 1, 1024, None, "none", True)
    assert parse_bytes("80GB") == 80 * 2**30 and parse_bytes("512MiB") == 512 * 2**20


# --- the measuring instruments the benchmarks and the test above rely on -----------------------
def test_saved_activations_leave_out_parameters_and_their_views():
    lin = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(8, 64, requires_grad=True)
    with SavedActivations() as saved:
        y = torch.nn.functional.linear(x, lin.weight) + x @ lin.weight.t()  # saves weight and weight.t()
        z = torch.tanh(y)  # saves its output: an activation
    assert saved.bytes == x.nbytes + z.nbytes
    z.sum().backward()  # the hooks hand back what they were given


def test_model_state_bytes_counts_shared_storage_once_and_buckets_apart():
    model = torch.nn.Sequential(torch.nn.Embedding(100, 16), torch.nn.Linear(16, 100, bias=False))
    model[1].weight = model[0].weight  # tied: one storage
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.arange(10)).sum().backward()
    opt.step()
    p = model[0].weight.nbytes
    step = 4  # Adam's step counter: a float32 scalar per parameter
    assert model_state_bytes(model, opt) == 4 * p + step  # weight + grad + exp_avg + exp_avg_sq

    class Engine:  # the shape of a DeepSpeed ZeRO optimizer: partitions plus reduction buckets
        def __init__(self, inner):
            self.optimizer = inner
            self.fp32_partition = [torch.zeros(50)]
            self.ipg_buckets = {0: torch.zeros(1000)}
            self.ipg_buffer = [model[0].weight.grad]  # a bucket that is a model state stays one

    buffers = {}
    states = model_state_bytes(model, Engine(opt), buffers)
    assert states == 4 * p + step + 50 * 4
    assert sum(buffers.values()) == 1000 * 4


def test_model_state_bytes_counts_fsdp2_sharded_gradients():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
        total = sum(p.nbytes for p in model.parameters())
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(3, 16)).sum().backward()
        assert all(type(p.grad).__name__ == "DTensor" for p in model.parameters())
        opt.step()
        # params, grads, Adam's two moments and its step counters (a float32 scalar per parameter)
        assert model_state_bytes(model, opt) == 4 * total + 4 * len(list(model.parameters()))
    finally:
        dist.destroy_process_group()


def test_planner_models_the_chunked_head_op_checkpointing_and_offload(tmp_path, capsys):
    """Each memory setting lowers the planned activations, in the order of what it keeps, and
    `tformer plan` shows the saving of each; BERT's head counts its labelled share only."""
    with torch.device("meta"):
        cfg = build_model("llama-1b").config
    kw = dict(return_logits=False)

    def act(ac="none", **extra):
        return activation_bytes(cfg, 1, 2048, None, ac, True, **kw, **extra)
    assert act(chunk=128) < act()
    # the unchunked head is (tokens x vocab); a chunk of 128 rows is 1/16 of it (+ the input gradient)
    assert act() - act(chunk=128) == pytest.approx((1 - 1 / 16) * 2048 * cfg.padded_vocab_size * 6, rel=0.02)
    assert act("full") < act("op") < act("none")
    assert act(offload=True) < act("full") and act("op", chunk=128, offload=True) < act(offload=True)
    with torch.device("meta"):
        bert = build_model("bert-base").config
    assert (activation_bytes(bert, 8, 512, None, "none", False, return_logits=False, labelled=0.15)
            < activation_bytes(bert, 8, 512, None, "none", False, return_logits=False))
    from tformer.cli import main
    assert main(["plan", str(CONFIGS / "llama-1b.yaml"), "micro_batch_size=1", "loss.chunk_size=256",
                 "--devices", "8", "--device-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "loss.chunk_size=256" in out and "what each memory setting saves per device" in out
    for row in ("activation_checkpointing=op", "activation_offload=true", "chunk 256 + op + offload"):
        assert row in out
    assert any(line.startswith("ddp") and " op " in line for line in out.splitlines())


from train_helpers import CONFIGS  # noqa: E402
