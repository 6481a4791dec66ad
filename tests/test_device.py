"""GPUs when present (agents/device.py, ``ray.gpus_per_cell``); on CPU-only machines everything runs as before.

Checked here: device resolution, ``--device`` on the training commands (``auto`` on a CPU-only machine is the CPU,
with the same numbers; ``cuda`` without CUDA is exit 2 and one line), the Ray options built for each kind of cell,
and a real Ray cluster granting those requests (its GPU declared logically: Ray schedules by declared resources).
The CUDA tests run where torch sees a CUDA device.
"""

from __future__ import annotations

import json

import pytest
import torch

from agents import CellRunner
from agents.cli import main as cli_main
from agents.device import resolve_device
from agents.ppo import train
from sae_env.experiment import ConfigError, cell_task, expand, load_config, remote_options, run_experiment

RUNNER = CellRunner()
CUDA = torch.cuda.is_available()
PPO_RUN = {"seed": 3, "env": {"capacity": 0.1, "window": 50, "segment_requests": 150},
           "ppo": {"num_envs": 2, "num_steps": 8, "total_steps": 32}}
CONFIG = {
    "name": "gpu",
    "workloads": [{"name": "tiny", "trace": {"source": "synthetic", "preset": "tiny"}}],
    "capacities": [0.2],
    "agents": ["lru", "saecache",
               {"name": "learned", "policy": "saecache", "agent": "ppo"},
               {"name": "predicted", "policy": "saecache", "agent": "fixed",
                "policy_options": {"predictor": "predictor.pt"}}],
    "serving": "instant",
    "window": 20,
    "wandb": {"mode": "disabled"},
}


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if CUDA else "cpu")
    with pytest.raises(ValueError, match="unknown device 'tpu'; valid: auto, cpu, cuda"):
        resolve_device("tpu")
    if not CUDA:
        with pytest.raises(ValueError, match="torch sees no CUDA device here"):
            resolve_device("cuda")


def test_gpus_per_cell_is_validated():
    for bad in (-0.5, 1.5, "half", True):
        with pytest.raises(ConfigError, match="ray.gpus_per_cell: expected a GPU fraction"):
            load_config({**CONFIG, "ray": {"gpus_per_cell": bad}}, RUNNER)
    for good in (0, 0.25, 1, 2):
        assert load_config({**CONFIG, "ray": {"gpus_per_cell": good}}, RUNNER).ray.gpus_per_cell == good


def test_remote_options_request_gpus_for_model_cells_only():
    config = load_config({**CONFIG, "ray": {"gpus_per_cell": 0.25, "retries": 2}}, RUNNER)
    tasks = {c.agent: cell_task(config, c) for c in expand(config)}
    base = {"num_cpus": 1, "max_retries": 2, "retry_exceptions": True}
    with_gpus = {name: remote_options(config, RUNNER, task, gpus=2) for name, task in tasks.items()}
    assert with_gpus == {"lru": base, "saecache": base, "learned": {**base, "num_gpus": 0.25},
                         "predicted": {**base, "num_gpus": 0.25}}
    # A cluster without GPUs, or a config that asks for none: no GPU request at all (Ray would wait forever).
    assert all(remote_options(config, RUNNER, t, gpus=0) == base for t in tasks.values())
    plain = load_config(CONFIG, RUNNER)
    assert all(remote_options(plain, RUNNER, t, gpus=2) == {**base, "max_retries": 1} for t in tasks.values())


def test_ray_grants_the_requests(tmp_path):
    """A real Ray cluster with one (declared) GPU gives a model cell's task a quarter of it and the others none."""
    from sae_env.ray_local import ray_cluster

    config = load_config({**CONFIG, "ray": {"gpus_per_cell": 0.25}}, RUNNER)
    tasks = {c.agent: cell_task(config, c) for c in expand(config)}

    def assigned() -> dict:
        import ray

        return {"resources": ray.get_runtime_context().get_assigned_resources(), "gpu_ids": ray.get_gpu_ids()}

    with ray_cluster(num_cpus=2, num_gpus=1) as ray:
        gpus = ray.cluster_resources()["GPU"]
        probe = ray.remote(assigned)
        got = {name: ray.get(probe.options(**remote_options(config, RUNNER, task, gpus)).remote())
               for name, task in tasks.items()}
    assert gpus == 1
    assert got["learned"]["resources"] == {"CPU": 1.0, "GPU": 0.25} and len(got["learned"]["gpu_ids"]) == 1
    assert got["predicted"]["resources"] == {"CPU": 1.0, "GPU": 0.25}
    assert got["lru"]["resources"] == {"CPU": 1.0} and got["lru"]["gpu_ids"] == []


@pytest.mark.skipif(CUDA, reason="checks the CPU-only behaviour")
def test_cpu_only_machine_runs_as_before(tmp_path):
    """gpus_per_cell on a machine without CUDA: the same cells, the same numbers, no device in any task."""
    config = {**CONFIG, "agents": CONFIG["agents"][:3], "output": str(tmp_path / "a")}
    plain = run_experiment(load_config(config, RUNNER), RUNNER, serial=True, progress=False, log=lambda m: None)
    asked = run_experiment(load_config({**config, "output": str(tmp_path / "b"), "ray": {"gpus_per_cell": 0.5}},
                                       RUNNER), RUNNER, serial=True, progress=False, log=lambda m: None)
    strip = {k: {kk: vv for kk, vv in v.items() if kk != "timing"} for k, v in plain.results.items()}
    assert strip == {k: {kk: vv for kk, vv in v.items() if kk != "timing"} for k, v in asked.results.items()}
    assert all("device" not in r["cell"] for r in asked.results.values())


def test_training_commands_take_device(tmp_path, capsys):
    path = tmp_path / "ppo.yaml"
    path.write_text(json.dumps(PPO_RUN))
    assert cli_main(["ppo", "--config", str(path), "--out", str(tmp_path / "auto"), "--no-wandb"]) == 0
    config = json.loads((tmp_path / "auto" / "config.json").read_text())
    assert config["device"] == ("cuda" if CUDA else "cpu")  # --device auto (the default)
    if not CUDA:  # auto is the CPU here: the library's CPU run, number for number
        metrics = json.loads((tmp_path / "auto" / "metrics.json").read_text())
        cpu = train(PPO_RUN, device="cpu").metrics
        strip = [{k: v for k, v in m.items() if k != "perf/sps"} for m in metrics]
        assert strip == [{k: v for k, v in m.items() if k != "perf/sps"} for m in cpu]
        capsys.readouterr()
        assert cli_main(["ppo", "--config", str(path), "--out", str(tmp_path / "c"), "--device", "cuda"]) == 2
        assert capsys.readouterr().err.strip().startswith("error: device 'cuda': torch sees no CUDA device here")
        assert cli_main(["predictor", "--train", "synthetic", "--opt", "preset=tiny", "--out",
                         str(tmp_path / "p.pt"), "--epochs", "1", "--device", "cuda", "--no-wandb"]) == 2
        assert "torch sees no CUDA device" in capsys.readouterr().err


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_training_on_cuda(tmp_path):
    """On a GPU: PPO and the predictor train there, and land close to their CPU runs (same seeded draws)."""
    from agents.session_predictor import SessionPredictor, train_predictor
    from sae_env.sources import trace_from_spec

    gpu, cpu = train(PPO_RUN, device="cuda"), train(PPO_RUN, device="cpu")
    assert gpu.config["device"].startswith("cuda") and next(gpu.model.parameters()).device.type == "cpu"
    for g, c in zip(gpu.metrics, cpu.metrics, strict=True):
        assert g["charts/mean_reward"] == pytest.approx(c["charts/mean_reward"], rel=1e-3)
    trace, _ = trace_from_spec({"source": "synthetic", "preset": "tiny"})
    report = train_predictor([trace], tmp_path / "p.pt", epochs=3, device="cuda", measure_throughput=False)
    assert report["device"].startswith("cuda")
    on_cpu = SessionPredictor.load(tmp_path / "p.pt")
    assert on_cpu.device.type == "cpu" and SessionPredictor.load(tmp_path / "p.pt", device="cuda").device.type == "cuda"
