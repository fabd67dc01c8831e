"""Interval saves written by torchtitan's own ``CheckpointManager`` (torchtitan 0.3.0, one
process, no process group), for tests/e2e/test_titan_manager.py: a small Llama 3 trained a
few steps with torchtitan's ``OptimizersContainer`` (AdamW), ``LRSchedulersContainer`` and
``ParallelAwareDataloader``, saved at the checkpoint interval with the train state.

What is torchtitan's own: the manager (its flattening of model, optimizer, lr_scheduler,
dataloader and train_state into one DCP state dict, the ``step-N`` folders, its ``load``),
the optimizer and scheduler containers, the data loader. What stands in, because torchtitan's
``Llama3Model`` and ``Trainer`` cannot be imported without triton (their package imports it
through the MoE token dispatcher):

* the model, :class:`TitanLlama`: torchtitan's Llama 3 parameter names and state dict on
  the weights of a transformers ``LlamaForCausalLM`` (``wq``/``wk`` rows in Meta's
  interleaved order, torchtitan's adapter's ``_reverse_permute``); in 0.3.0's form the
  projections are one fused ``attention.qkv_linear.wqkv`` parameter whose state dict splits
  into ``wq``/``wk``/``wv`` and merges back (``FusedQKVLinear``'s hooks written out here),
  and the head is ``lm_head``; gradients come from transformers' backward on the same
  weights;
* the train state: 0.3.0's ``Trainer.state_dict`` (``step``, ``ntokens_seen``, plain ints)
  or, for saves before torchtitan 0.1, its ``TrainState`` (``step`` an int32 tensor, the
  loss history as ``torch.save`` bytes).

The run resumed at ``START`` with a fresh optimizer (torchtitan's
``--checkpoint.exclude_from_loading optimizer``), so at the save the train state's step
(``INTERVAL``) and the optimizer's (``INTERVAL - START``) differ.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch
import transformers
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from tests.e2e.titan_writer import interleaved, titan_key

START, INTERVAL = 3, 5
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
FORMS = {"titan-0.3": dict(qkv="attention.qkv_linear.", head="lm_head.weight", fused=True,
                           state="trainer"),
         "titan-before-0.1": dict(qkv="attention.", head="output.weight", fused=False,
                                  state="train_state")}


def rotate_half(w: torch.Tensor, heads: int) -> torch.Tensor:
    """torchtitan's adapter's ``_permute``: interleaved rows back to Hugging Face's order."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def split_qkv(t: torch.Tensor, kv_heads: int, width: int) -> tuple:
    """``FusedQKVLinear._split_qkv_on_save`` for a plain tensor: (q, k, v) rows."""
    cols = t.shape[1]
    w = t.reshape(kv_heads, -1, width, cols)
    per = w.shape[1] - 2
    return (w[:, :per].reshape(-1, cols).contiguous(), w[:, per].reshape(-1, cols).contiguous(),
            w[:, per + 1].reshape(-1, cols).contiguous())


def merge_qkv(q, k, v, kv_heads: int, width: int) -> torch.Tensor:
    """``FusedQKVLinear._merge_qkv_on_load`` for plain tensors."""
    cols = q.shape[1]
    return torch.cat([q.reshape(kv_heads, -1, width, cols), k.reshape(kv_heads, 1, width, cols),
                      v.reshape(kv_heads, 1, width, cols)], dim=1).reshape(-1, cols)


class TitanLlama(nn.Module):
    """torchtitan's Llama 3 parameters and state dict (see the module's docstring)."""

    def __init__(self, hf_params: dict, sizes: dict, form: dict):
        super().__init__()
        self.sizes, self.form = sizes, form
        self.kv_heads = sizes["num_key_value_heads"]
        self.width = sizes["hidden_size"] // sizes["num_attention_heads"]
        for name, value in to_titan(hf_params, sizes, form).items():
            *path, leaf = name.split(".")
            module = self
            for part in path:
                if part not in module._modules:
                    module.add_module(part, nn.Module())
                module = module._modules[part]
            module.register_parameter(leaf, nn.Parameter(value.clone()))
        if form["fused"]:
            split, merge = qkv_hooks(self.kv_heads, self.width)
            for layer in self.layers.children():
                layer.attention.qkv_linear.register_state_dict_post_hook(split)
                layer.attention.qkv_linear.register_load_state_dict_pre_hook(merge)


def qkv_hooks(kv_heads: int, width: int):
    """``FusedQKVLinear``'s state-dict hooks: the fused ``wqkv`` saved as ``wq``/``wk``/``wv``
    and merged back on load."""

    def split(module, state_dict, prefix, local_metadata) -> None:
        fused = state_dict.pop(f"{prefix}wqkv.weight")
        for w, part in zip(("wq", "wk", "wv"), split_qkv(fused, kv_heads, width)):
            state_dict[f"{prefix}{w}.weight"] = part

    def merge(module, state_dict, prefix, *args) -> None:
        keys = [f"{prefix}{w}.weight" for w in ("wq", "wk", "wv")]
        if all(k in state_dict for k in keys):
            parts = [state_dict.pop(k) for k in keys]
            state_dict[f"{prefix}wqkv.weight"] = merge_qkv(*parts, kv_heads, width)

    return split, merge


def to_titan(hf: dict, sizes: dict, form: dict) -> dict:
    """{torchtitan parameter: tensor} of Hugging Face-named tensors ``hf`` (weights or
    gradients): q/k rows interleaved, and in the fused form each layer's q, k, v merged."""
    heads = {"q_proj": sizes["num_attention_heads"], "k_proj": sizes["num_key_value_heads"]}
    out = {}
    for name, t in hf.items():
        n = next((h for part, h in heads.items() if f".{part}." in name), None)
        out[titan_key(name, form["qkv"], form["head"])] = interleaved(t, n) if n else t
    if form["fused"]:
        width = sizes["hidden_size"] // sizes["num_attention_heads"]
        for layer in range(sizes["num_hidden_layers"]):
            prefix = f"layers.{layer}.{form['qkv']}"
            parts = [out.pop(f"{prefix}{w}.weight") for w in ("wq", "wk", "wv")]
            out[f"{prefix}wqkv.weight"] = merge_qkv(*parts, sizes["num_key_value_heads"], width)
    return out


def hf_names(sizes: dict) -> list[str]:
    """The parameter names of transformers' ``LlamaForCausalLM`` of ``sizes``."""
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    return [name for name, _ in model.named_parameters()]


def to_hf(titan: dict, sizes: dict, form: dict) -> dict:
    """{Hugging Face name: tensor} of torchtitan-named tensors (a model's state dict, or the
    optimizer's state of each parameter): fused q/k/v split, q/k rows back in rotate-half
    order. The inverse of :func:`to_titan`, written from torchtitan's side."""
    width = sizes["hidden_size"] // sizes["num_attention_heads"]
    split = {}
    for key, t in titan.items():
        if key.endswith("wqkv.weight"):
            for w, part in zip(("wq", "wk", "wv"),
                               split_qkv(t, sizes["num_key_value_heads"], width)):
                split[key.replace("wqkv", w)] = part
        else:
            split[key] = t
    heads = {"q_proj": sizes["num_attention_heads"], "k_proj": sizes["num_key_value_heads"]}
    out = {}
    for name in hf_names(sizes):
        t = split[titan_key(name, form["qkv"], form["head"])]
        n = next((h for part, h in heads.items() if f".{part}." in name), None)
        out[name] = rotate_half(t, n) if n else t
    return out


class TokenWindows(IterableDataset, Stateful):
    """Windows of a fixed random token stream, resumable (torchtitan's datasets keep their
    position as ``sample_idx``)."""

    def __init__(self, vocab: int, seq: int):
        self.tokens = torch.randint(0, vocab, (64 * seq + 1,), generator=torch.Generator()
                                    .manual_seed(7))
        self.seq, self.sample_idx = seq, 0

    def __iter__(self):
        while True:
            at = (self.sample_idx * self.seq) % (len(self.tokens) - self.seq - 1)
            self.sample_idx += 1
            window = self.tokens[at:at + self.seq + 1]
            yield {"input": window[:-1]}, window[1:]

    def state_dict(self):
        return {"sample_idx": self.sample_idx}

    def load_state_dict(self, state):
        self.sample_idx = state["sample_idx"]


class TrainerState(Stateful):
    """torchtitan 0.3.0's ``Trainer.state_dict`` / ``load_state_dict`` (torchtitan/trainer.py)."""

    def __init__(self, step: int = 0):
        self.step, self.ntokens_seen = step, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict):
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


class TrainState(Stateful):
    """torchtitan's ``TrainState`` before 0.1 (components/checkpoint.py until commit b925cfa,
    March 2025): the step as an int32 tensor, the loss history as ``torch.save`` bytes."""

    def __init__(self, step: int = 0):
        self.step, self.global_avg_losses, self.global_max_losses, self.log_steps = \
            step, [], [], []

    def state_dict(self):
        def saved(value):
            buffer = io.BytesIO()
            torch.save(value, buffer)
            return buffer

        return {"step": torch.tensor(self.step, dtype=torch.int32),
                "global_avg_losses": saved(self.global_avg_losses),
                "global_max_losses": saved(self.global_max_losses),
                "log_steps": saved(self.log_steps)}

    def load_state_dict(self, state_dict):
        self.step = state_dict["step"].item()
        for key in ("global_avg_losses", "global_max_losses", "log_steps"):
            state_dict[key].seek(0)
            setattr(self, key, torch.load(state_dict[key], weights_only=False))


def components(folder: Path, sizes: dict, form: dict, seed: int, exclude=()) -> dict:
    """A model, torchtitan's optimizer, scheduler, data loader, a train state at ``START``
    and the ``CheckpointManager`` of them saving to ``folder`` every ``INTERVAL`` steps."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    model = TitanLlama({k: v.detach() for k, v in hf.named_parameters()}, sizes, form)
    optimizers = OptimizersContainer(OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs=HYPER)],
        implementation="for-loop"), model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=20)
    schedulers.load_state_dict({"last_epoch": START})  # resumed, like the train state
    data = ParallelAwareDataloader(TokenWindows(sizes["vocab_size"], 16), dp_rank=0,
                                   dp_world_size=1, batch_size=2)
    state = (TrainerState if form["state"] == "trainer" else TrainState)(START)
    manager = CheckpointManager(
        CheckpointManager.Config(enable=True, folder=str(folder), interval=INTERVAL,
                                 keep_latest_k=0, exclude_from_loading=list(exclude)),
        dataloader=data, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": state}, sd_adapter=None)
    return dict(hf=hf, model=model, optimizers=optimizers, schedulers=schedulers, data=data,
                state=state, manager=manager)


def train_and_save(folder: Path, sizes: dict, form: dict, seed: int = 0) -> dict:
    """Train from ``START`` to ``INTERVAL`` and let the manager save ``folder/step-N``;
    returns the components and, as saved, the model's state dict, the optimizer's flat
    state dict and the train state's step."""
    c = components(folder, sizes, form, seed)
    batches = iter(c["data"])
    while c["state"].step < INTERVAL:
        c["state"].step += 1
        inputs, labels = next(batches)
        c["hf"].zero_grad()
        logits = c["hf"](inputs["input"]).logits
        nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
        grads = to_titan({k: p.grad for k, p in c["hf"].named_parameters()}, sizes, form)
        for name, p in c["model"].named_parameters():
            p.grad = grads[name].clone()
        c["optimizers"].step()
        c["schedulers"].step()
        c["optimizers"].zero_grad()
        with torch.no_grad():  # the same weights for the next gradient
            for name, value in to_hf(dict(c["model"].named_parameters()), sizes, form).items():
                c["hf"].get_parameter(name).copy_(value)
        if isinstance(c["state"], TrainerState):
            c["state"].ntokens_seen += labels.numel()
        assert c["manager"].save(c["state"].step) == (c["state"].step == INTERVAL)
    c["saved"] = dict(model={k: v.clone() for k, v in c["model"].state_dict().items()},
                      optimizer={k: v.clone() if torch.is_tensor(v) else v
                                 for k, v in c["optimizers"].state_dict().items()},
                      step=c["state"].step)
    c["manager"].close()
    return c
