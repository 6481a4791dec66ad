"""Stable-Baselines3 on the env (the optional ``sb3`` extra; part of ``test``, so CI runs these).

Real SB3: its env checker, ``make_vec_env`` (which asks for ``render_mode="rgb_array"`` and falls back only on a
TypeError), PPO training, and ``evaluate_policy`` scoring our agents through :class:`agents.sb3.AgentPolicy`.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest

sb3 = pytest.importorskip("stable_baselines3")

from stable_baselines3.common.env_checker import check_env  # noqa: E402
from stable_baselines3.common.env_util import make_vec_env  # noqa: E402
from stable_baselines3.common.evaluation import evaluate_policy  # noqa: E402

from agents import FixedAgent, SAEOnlineAgent, evaluate  # noqa: E402
from agents.sb3 import AgentPolicy  # noqa: E402
from sae_env import ENV_ID  # noqa: E402
from sae_env.env import PrefixCacheEnv  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_sb3_check_env_passes():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # SB3's checker reports problems as warnings
        check_env(PrefixCacheEnv(policy="saecache", capacity=0.05), warn=True)


def test_make_vec_env_falls_back_from_rgb_array():
    vec = make_vec_env(ENV_ID, n_envs=2, seed=0, env_kwargs={"capacity": 0.05})
    try:
        assert vec.num_envs == 2 and all(e.unwrapped.render_mode is None for e in vec.envs)
        obs = vec.reset()
        assert obs["hit_rate"].shape == (2, 2)
    finally:
        vec.close()


@pytest.mark.parametrize("agent", [SAEOnlineAgent(), FixedAgent()], ids=lambda a: a.name)
def test_agent_policy_scores_what_our_loop_scores(agent):
    """Differential: evaluate_policy through AgentPolicy gives the episode reward of agents.evaluate's own loop."""
    config = {"capacity": 0.05, "window": 60}
    ours = evaluate(agent, config, seed=3)["summary"]["episode_reward"]
    vec = make_vec_env(ENV_ID, n_envs=2, seed=3, env_kwargs=config)
    rewards, lengths = evaluate_policy(AgentPolicy(agent, vec), vec, n_eval_episodes=4, return_episode_rewards=True)
    vec.close()
    assert rewards == pytest.approx([ours] * 4, abs=6e-7)  # SB3's Monitor rounds to 6 decimals
    assert len(set(lengths)) == 1 and lengths[0] > 2


def test_agent_policy_needs_envs_in_this_process():
    with pytest.raises(ValueError, match="DummyVecEnv"):
        AgentPolicy(FixedAgent(), object())


def test_readme_sb3_example_runs(capsys, tmp_path, monkeypatch):
    """The README's SB3 example, as printed there: PPO trained on make_vec_env(n_envs=2) for 2,048 steps, then
    compared with SAECache's online learners and its defaults by evaluate_policy."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # SB3's learn() leaves a logger folder (SB3-<date>) there
    text = (ROOT / "README.md").read_text()
    code = text.split("```python\n# sb3_ppo.py\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "README.md (sb3_ppo.py)", "exec"), namespace)
    model, scores = namespace["model"], namespace["scores"]
    assert model.num_timesteps >= 2048 and model.get_env().num_envs == 2
    assert set(scores) == {"sb3-ppo", "saecache-online", "saecache-defaults"}
    assert all(np.isfinite(v) and v > 0 for v in scores.values())
    # The online learners beat their own defaults on this workload (the README prints the figures).
    assert scores["saecache-online"] > scores["saecache-defaults"]
    online = evaluate(SAEOnlineAgent(), namespace["env_kwargs"], seed=1)["summary"]["episode_reward"]
    assert scores["saecache-online"] == pytest.approx(online, abs=6e-7)
    assert "sb3-ppo" in capsys.readouterr().out
