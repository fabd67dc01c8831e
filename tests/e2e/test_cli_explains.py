"""The CLI explains itself, through the real command (``python -m hpctrain``): --version,
the help of the top level, train and plan, plan's world size from the config's layout, the
README's plan commands as written, and export and generate of a Hugging Face directory."""

import re
import subprocess

import pytest
from launch import ROOT, TINY, env, hpctrain

pytestmark = pytest.mark.e2e


def test_version_names_the_package_and_the_commit():
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    out = hpctrain(["--version"]).stdout
    assert re.fullmatch(r"hpctrain \d+\.\d+\.\d+ \(commit \S+\)\n", out), out
    assert head in out, out  # "" where the code is not a git checkout


def test_help_says_how_to_launch_and_what_plan_does():
    top = hpctrain(["--help"]).stdout
    assert "hpctrain trains large neural networks" in top and "srun -n 4" in top
    train = hpctrain(["train", "--help"]).stdout
    assert "mpirun -n 4 hpctrain train share/configs/demo.toml" in train, train
    assert "srun -n 4 hpctrain train" in train
    plan = " ".join(hpctrain(["plan", "--help"]).stdout.split())
    assert "Predict a layout's memory per rank and step time, and search layouts" in plan
    assert "--world-size WORLD_SIZE number of ranks to plan for (default: the product" in plan


def test_plan_takes_the_world_size_from_the_layout():
    out = hpctrain(["plan", TINY, "--set", "topology.dp=2", "--set", "topology.pp=2"]).stdout
    assert out.startswith("4 ranks (from the config's topology): dp=2 (ep=1) x tp=1 x pp=2")


def readme_commands(word: str) -> list[str]:
    """The README's shell commands (continuation lines joined) that contain ``word``."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [line.strip() for line in lines if word in line and not line.lstrip().startswith("#")]


def test_the_readme_plan_commands_run_as_written():
    commands = readme_commands("-m hpctrain plan")
    assert any("--search" in c for c in commands), commands
    for command in commands:
        p = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env(), capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, (command, p.stderr[-2000:])
        says = "best as --set arguments" if "--search" in command else "performance on dgx-a100"
        assert says in p.stdout, (command, p.stdout[-2000:])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny LlamaForCausalLM saved by transformers (model.safetensors + config.json)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
        initializer_range=0.2, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config)
    out = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(out)
    return out, model


def test_generate_from_a_hugging_face_directory(hf_dir):
    """Greedy tokens from the directory equal transformers' own greedy tokens."""
    import torch

    directory, model = hf_dir
    out = hpctrain(["generate", str(directory), "--tokenizer", "bytes", "--prompt", "ab",
                    "--tokens", "8", "--temperature", "0"]).stdout
    with torch.no_grad():
        ids = model.generate(torch.tensor([list(b"ab")]), max_new_tokens=8, do_sample=False,
                             pad_token_id=0)[0, 2:].tolist()
    assert out == "ab" + bytes(ids).decode("utf-8", errors="replace") + "\n", (out, ids)


def test_export_a_hugging_face_directory(hf_dir, tmp_path):
    """--format hf gives back the same tensors bit for bit; the default format writes
    OUT.safetensors in hpctrain's names with its config beside it."""
    from safetensors.torch import load_file

    directory, _ = hf_dir
    original = load_file(str(directory / "model.safetensors"))
    hpctrain(["export", str(directory), "--format", "hf", "--out", str(tmp_path / "hf")])
    again = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(again) == set(original)
    assert all(again[k].dtype == original[k].dtype and again[k].equal(original[k])
               for k in original)
    hpctrain(["export", str(directory), str(tmp_path / "mine")])
    mine = load_file(str(tmp_path / "mine.safetensors"))
    assert mine["embed"].equal(original["model.embed_tokens.weight"])
    assert len(mine) == len(original)
    assert "[model]" in (tmp_path / "mine.safetensors.config.toml").read_text()
