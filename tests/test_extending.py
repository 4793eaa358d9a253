"""docs/extending.md, recipe by recipe: each test takes the recipe's code and command from the document itself and
does what it says, so the document cannot drift from what works."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from config import grpo
from config.validate import ConfigError, validate

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "extending.md"


def recipe(title: str) -> str:
    """The text of the recipe under the heading `## <title>`, up to the next heading of that level."""
    text = DOC.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def write_module(block: str, root: Path) -> str:
    """Write a recipe's module where its first line says (`# my_package/my_rewards.py ...`), with the package's
    empty __init__.py; returns the module's dotted name."""
    path = Path(re.match(r"#\s*(\S+\.py)", block).group(1))
    (root / path.parent).mkdir(parents=True, exist_ok=True)
    (root / path.parent / "__init__.py").touch()
    (root / path).write_text(block)
    return ".".join(path.with_suffix("").parts)


def command(block: str) -> tuple[dict[str, str], list[str]]:
    """The recipe's shell command as (its environment assignments, the python command's arguments)."""
    words = shlex.split(block.replace("\\\n", " "))
    env = dict(w.split("=", 1) for w in words[:words.index("python")])
    return env, words[words.index("python") + 1:]


def run_recipe(title: str, tmp_path: Path) -> tuple[str, str, Path, list[dict], list[str], Path]:
    """Do what the recipe says: write its module into a folder of the user's own, run its command with that folder
    on PYTHONPATH, the run folder moved into tmp_path and two epochs (the preset runs 20). Returns (the recipe's
    text, its command, the run folder, the run's metrics.jsonl records, the command's arguments as run less the
    epochs, the user's folder)."""
    text = recipe(title)
    (module_block,) = blocks(text, "python")
    (command_block,) = blocks(text, "bash")
    code = tmp_path / "my_code"
    module = write_module(module_block, code)
    env, args = command(command_block)
    assert env.keys() == {"PYTHONPATH"} and f"--config.plugins={module}" in args
    run_dir = tmp_path / "run"
    args = [re.sub(r"^--config\.run_dir=.*", f"--config.run_dir={run_dir}", a) for a in args]
    p = _run([*args, "--config.num_epochs=2"], code)
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return text, command_block, run_dir, records, args, code


def _run(args: list[str], code: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"})


def test_recipe_1_a_reward(tmp_path):
    text, command_block, run_dir, records, _, _ = run_recipe("1. A reward", tmp_path)
    name, weight = re.search(r"--config\.reward\.weights\.(\w+)=([\d.]+)", command_block).groups()
    epochs = [r for r in records if r["type"] == "epoch"]
    assert len(epochs) == 2
    preset = dict(grpo.get_config("toy").reward.weights)
    weights = {**preset, name: float(weight)}
    for e in epochs:
        assert f"reward_{name}" in e and f"detail_{name}/l1" in e  # scored, with its details
        # and weighted: the mean of sum_i w_i r_i / sum_i w_i over the epoch's samples
        per_sample = [sum(w * e[f"rewards/{n}"][i] for n, w in weights.items()) / sum(weights.values())
                      for i in range(len(e["rewards/avg"]))]
        assert e["reward_avg"] == pytest.approx(sum(per_sample) / len(per_sample), rel=1e-5)
    final = [r for r in records if r["type"] == "eval" and r["tag"] == "final"][0]
    assert f"eval/{name}" in final
    assert re.search(rf"^\| {name} \|", (run_dir / "summary.md").read_text(), flags=re.M)  # its own summary row


def test_recipe_1_a_reward_of_another_kind_is_refused_as_the_recipe_shows(tmp_path, monkeypatch):
    import rewards

    text = recipe("1. A reward")
    code = tmp_path / "my_code"
    module = write_module(blocks(text, "python")[0], code)
    name = re.search(r"--config\.reward\.weights\.(\w+)=", blocks(text, "bash")[0]).group(1)
    monkeypatch.syspath_prepend(str(code))
    registered = dict(rewards.REWARDS)
    try:
        config = grpo.get_config("smoke")
        config.plugins = module
        from config.plugins import import_plugins

        assert import_plugins(config) == [module]
        config.reward.weights[name] = 0.5
        with pytest.raises(ConfigError) as err:
            validate(config, 1)
    finally:  # the recipe's reward registered in this process only for this test
        rewards.REWARDS.clear()
        rewards.REWARDS.update(registered)
        for m in [m for m in sys.modules if m == module.split(".")[0] or m.startswith(module.split(".")[0] + ".")]:
            del sys.modules[m]
    shown = re.search(r"```\n(config error: .*?)```", text, flags=re.S).group(1)
    assert f"config error: {err.value}" == " ".join(shown.split())


def test_a_plugin_that_does_not_import_is_one_config_error_naming_it():
    from config.plugins import import_plugins

    config = grpo.get_config("toy")
    config.plugins = "recam_no_such_package.rewards"
    with pytest.raises(ConfigError, match=r"^plugins: cannot import 'recam_no_such_package\.rewards': "):
        import_plugins(config)



def test_recipe_2_a_policy_loss(tmp_path):
    text, command_block, run_dir, records, args, code = run_recipe("2. A policy loss", tmp_path)
    train = dict(re.findall(r"--config\.train\.(\w+)=(\S+)", command_block))
    loss = train.pop("policy_loss")
    ((setting, value),) = train.items()  # the loss's own setting, which the preset does not list

    config = json.loads((run_dir / "config.json").read_text())
    assert config["train"]["policy_loss"] == loss and config["train"][setting] == float(value)
    steps = [r for r in records if r["type"] == "step"]
    assert len(steps) == 4  # two optimizer steps per epoch
    named = set(re.findall(rf"`({loss}/\w+)`", text))  # the metrics "What you get" names
    assert named == {f"{loss}/capped", f"{loss}/weight_cap"}
    for s in steps:  # the loss ran (only it logs these), with the setting from the command line
        assert named <= set(s) and {"loss", "policy_loss", "kl_penalty", "grad_norm"} <= set(s)
        assert s[f"{loss}/weight_cap"] == pytest.approx(1 + float(value), rel=1e-6)
        assert 0 <= s[f"{loss}/capped"] <= 1

    # a value out of range: refused as the recipe shows, one line, before a run folder exists
    shown = re.search(r"```\n(config error: .*?)```", text, flags=re.S).group(1).strip()
    field, bad = re.match(r"config error: train\.(\w+) must .* got (\S+)$", shown).groups()
    assert field == setting
    bad_dir = tmp_path / "refused"
    args = [re.sub(rf"^--config\.train\.{field}=.*", f"--config.train.{field}={bad}", a) for a in args]
    args = [re.sub(r"^--config\.run_dir=.*", f"--config.run_dir={bad_dir}", a) for a in args]
    p = _run(args, code)
    assert p.returncode == 2 and p.stderr.strip() == shown, p.stderr[-3000:]
    assert not bad_dir.exists()

    # the loss's setting is the run's config like any other field: a resume that changes it is refused
    good = [re.sub(rf"^--config\.train\.{field}=.*", f"--config.train.{field}={float(value) * 2}", a) for a in args]
    good = [re.sub(r"^--config\.run_dir=.*", f"--config.run_dir={run_dir}", a) for a in good]
    p = _run([*good, "--config.num_epochs=3"], code)
    assert p.returncode == 2, p.stderr[-3000:]
    assert f"train.{field} is {float(value) * 2} here but {float(value)} in the run" in p.stderr.strip(), p.stderr


def test_recipe_3_a_domain(tmp_path):
    _, command_block, run_dir, records, _, _ = run_recipe("3. A domain", tmp_path)
    domain = re.search(r"--config\.domain=(\w+)", command_block).group(1)
    assert json.loads((run_dir / "config.json").read_text())["domain"] == domain
    epochs = [r for r in records if r["type"] == "epoch"]
    assert len(epochs) == 2
    for e in epochs:  # the domain's own reward drove training, the preset's switched-off one was never built
        assert "reward_closeness" in e and "detail_closeness/distance" in e and "reward_target" not in e
        assert e["reward_avg"] == pytest.approx(e["reward_closeness"], rel=1e-6)
        assert e["condition_ids"][0].startswith("train/")
    assert [r["type"] for r in records if r["type"] == "step"] == ["step"] * 4  # two optimizer steps per epoch
    final = [r for r in records if r["type"] == "eval" and r["tag"] == "final"][0]
    assert 0 <= final["eval/closeness"] <= 1 and "val/closeness" in final
    assert re.search(r"^\| closeness \|", (run_dir / "summary.md").read_text(), flags=re.M)
    assert (run_dir / "examples" / "final" / "samples.txt").read_text().startswith("target -> sample\n")
