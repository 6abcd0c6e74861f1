"""hvd_compress inside PyTorch Lightning, and the DDP hook's state made without its model.

One launch of tests/workers/lightning_worker.py with plain ``python``: Lightning's
``Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(ddp_comm_state=
CompressionState(compression=...), ddp_comm_hook=compression_hook))`` starts the second
process itself (Gloo).  Checked here: both ranks end with the same parameters, the
hook sent fewer bytes than dense float32, the state's names are the LightningModule's
``named_parameters()`` names, the ``CompressionStats`` callback logged every step's
bytes to the CSV logger, and (same processes, plain DDP) a state registered by hand is
bound at the first bucket and ``register(grad_scaler=)`` is amp's ``register_ddp``;
compressed updates (a second fit: AdamW, the state given its optimizer by the strategy).
In-process: ``Stats.scalars`` and its TensorBoard one-liner.  No Horovod.
"""
import csv
import json
import os
import sys

import numpy as np
import pytest

from launch import ROOT, run_job

WORKER = ROOT / "tests/workers/lightning_worker.py"
STEPS = 6
#: Tiny's parameters: conv (4, 1, 5, 5) + 4, fc (10, 256) + 10, as float32 bytes
DENSE = 4 * (4 * 25 + 4 + 10 * 256 + 10)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    env = dict(os.environ, OUT_DIR=str(out), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                          if p))
    rc, log = run_job([sys.executable, WORKER], 300, env, cwd=out, what="the Lightning job")
    assert rc == 0, log[-6000:]
    info = [json.load(open(out / f"lightning_rank{r}.json")) for r in range(2)]
    params = [dict(np.load(out / f"lightning_rank{r}.npz")) for r in range(2)]
    return out, info, params, log


def test_both_ranks_end_equal(job):
    """Lightning launched two processes of one world and both end with the same bits."""
    _, info, params, _ = job
    assert sorted(i["rank"] for i in info) == [0, 1] and info[0]["world"] == 2
    assert params[0].keys() == params[1].keys() and len(params[0]) == 8
    for n in params[0]:
        np.testing.assert_array_equal(params[0][n], params[1][n], err_msg=n)


def test_compressed_updates_through_lightning(job):
    """The second Trainer: the state made without model and optimizer took the AdamW of
    configure_optimizers() (with a StepLR), and at its second fit the new AdamW (the first
    gets its own step() back); every step exchanged the update (the parameters above
    agree on both ranks and moved), each rank's AdamW state is its own, top-k at 5% sent
    far fewer bytes than dense.  The state learnt the world size only from the strategy,
    and logged the learning-rate hint then."""
    assert "on 2 ranks: sparsified AdamW updates trained best at about sqrt(2) = 1.4" in job[3]
    for i in job[1]:
        assert i["update_taken"] and i["first_restored"] and i["update_moved"] > 0
        assert i["update_steps"] == STEPS           # the second fit's optimizer: its steps
        assert i["update_lr"] == pytest.approx(3e-3 * 0.5 ** (STEPS // 2))   # StepLR stepped
        s = i["update_stats"]
        assert s["steps"] == 2 * STEPS and s["total_dense"] == 2 * STEPS * DENSE
        assert 0 < s["total_sent"] < s["total_dense"] / 5, s
    assert job[1][0]["update_exp_avg"] != job[1][1]["update_exp_avg"]


def test_bytes_saved(job):
    """Every step went through the hook: topk at 5% sends far fewer bytes than dense."""
    for i in job[1]:
        s = i["stats"]
        assert s["steps"] == STEPS
        assert s["total_dense"] == STEPS * DENSE
        assert 0 < s["total_sent"] < s["total_dense"] / 5, s
        assert len(i["sent"]) == STEPS and all(0 < b < DENSE / 5 for b in i["sent"])


def test_names_are_the_modules(job):
    """The state made without the model took the LightningModule's parameter names, and
    its error-feedback state is keyed by them."""
    for i in job[1]:
        assert i["names"] == i["model_names"] == ["conv.bias", "conv.weight", "fc.bias",
                                                  "fc.weight"]
        text = json.dumps(i["keys"])
        assert i["keys"], i["keys"]
        assert not any(str(k).isdigit() for k in i["keys"]), text


def test_callback_logged_every_step(job):
    """CompressionStats logged compression/* each step: the CSV logger's rows hold
    rank 0's per-step sent bytes, the dense bytes and their ratio."""
    out, info = job[0], job[1]
    rank0 = next(i for i in info if i["rank"] == 0)
    files = list(out.glob("logs/*/metrics.csv"))
    assert len(files) == 1, files
    rows = [r for r in csv.DictReader(open(files[0])) if r.get("compression/sent_bytes")]
    assert [int(float(r["step"])) for r in rows] == list(range(STEPS))
    assert [float(r["compression/sent_bytes"]) for r in rows] == [float(b) for b in rank0["sent"]]
    for r, sent in zip(rows, rank0["sent"]):
        assert float(r["compression/dense_bytes"]) == DENSE
        assert float(r["compression/ratio"]) == pytest.approx(DENSE / sent)
    assert float(rows[-1]["compression/total_sent_bytes"]) == rank0["stats"]["total_sent"]
    assert rank0["logged"]["compression/total_dense_bytes"] == STEPS * DENSE


def test_state_without_model_on_plain_ddp(job):
    """CompressionState(compression=...) registered by hand on a plain DDP model: the hook
    found the model at its first bucket, took its names, and both ranks got the same
    aggregate; its state_dict loaded into another unbound state, on a copy of the model,
    gives the same next step bit for bit."""
    a, b = job[1]
    for i in (a, b):
        assert i["unbound_names"] == ["0.bias", "0.weight", "1.bias", "1.weight"]
        assert i["unbound_steps"] == 1
    assert a["unbound_grad"] == b["unbound_grad"]
    assert a["restored_equal"] and b["restored_equal"]       # checkpoint keyed by name


def test_register_grad_scaler(job):
    """register(grad_scaler=) is amp.register_ddp: the state has its GradientUnits and
    the scaled step went through the hook on both ranks alike."""
    a, b = job[1]
    assert a["amp"] == b["amp"] == "GradientUnits"
    assert a["amp_steps"] == b["amp_steps"] == 1
    assert a["amp_weight"] == b["amp_weight"]


def test_stats_scalars_and_tensorboard(tmp_path):
    """Stats.scalars: the last step's numbers as floats; the documented TensorBoard
    one-liner writes them as scalars an event reader reads back."""
    from hvd_compress.stats import Stats
    s = Stats()
    s.add(100, 1000, received=50)
    s.end_step()
    v = s.scalars()
    assert v["compression/sent_bytes"] == 100.0 and v["compression/dense_bytes"] == 1000.0
    assert v["compression/ratio"] == 10.0 and v["compression/received_bytes"] == 50.0
    assert all(isinstance(x, float) for x in v.values())
    assert "compression/ratio" not in Stats().scalars()       # nothing sent yet
    from torch.utils.tensorboard import SummaryWriter
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    writer = SummaryWriter(str(tmp_path))
    for k, x in s.scalars().items(): writer.add_scalar(k, x, 0)   # noqa: E701 (the one-liner)
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert acc.Scalars("compression/ratio")[0].value == 10.0


def test_stats_callback_warns_without_hook_and_checks_state(caplog):
    """Lightning's own DDPStrategy skips the comm hook on CPU: after an optimizer step with
    no bucket through the hook CompressionStats warns (once) and logs nothing; a state
    that is not a CompressionState is a ValueError naming state."""
    import logging
    from types import SimpleNamespace
    from hvd_compress.ddp import CompressionState
    from hvd_compress.lightning import CompressionStats

    logged = []
    module = SimpleNamespace(log_dict=lambda *a, **k: logged.append(a),
                             log=lambda *a, **k: logged.append(a))
    state = CompressionState(compression="topk:density=0.1")
    trainer = SimpleNamespace(strategy=SimpleNamespace(_ddp_comm_state=state), global_step=1)
    cb = CompressionStats()
    with caplog.at_level(logging.WARNING, logger="hvd_compress"):
        cb.on_train_batch_end(trainer, module, None, None, 0)
        cb.on_train_batch_end(trainer, module, None, None, 1)
    warnings = [r for r in caplog.records if "registers ddp_comm_hook only on CUDA" in r.message]
    assert len(warnings) == 1 and logged == [] and cb.state is state
    with pytest.raises(ValueError, match="state"):
        CompressionStats(state="topk")
