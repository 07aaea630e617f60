"""The GRPO job's two learners as plain classes; `actors.py` wraps them for Ray (the
third role, the engine, is `rollout_worker.py`).

PolicyLearner owns the HF policy and its optimiser (their part of a checkpoint is
policy_checkpoint.py's); its forward over a rollout yields both the log-probs GRPO needs
and the hidden states the draft learns from. The draft learner is draft/learner.py's;
JobDraftLearner adds the job's resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from grpo_specdec.checkpoint_pointer import latest_checkpoint
from grpo_specdec.draft.capture import Sequence, forward_with_hidden, pad_batch
from grpo_specdec.draft.learner import DraftData, DraftLearner
from grpo_specdec.draft.trainer import DraftTrainConfig
from grpo_specdec.grpo.core import grpo_loss, loss_stat_names
from grpo_specdec.job import sharding
from grpo_specdec.job.config import PolicySettings
from grpo_specdec.job.policy_checkpoint import load_policy, save_policy, untied
from grpo_specdec.job.precision import autocast_dtype


@dataclass
class PolicyBatch:
    """Sequences of one rollout with their GRPO advantages."""

    token_ids: list[list[int]]
    prompt_lens: list[int]
    advantages: list[float]
    informative: list[bool]  # groups with reward variance; the others train only the draft
    # What the responses were sampled at: the surrogate's log-probabilities are those of the
    # distribution the engine sampled from (as verl and TRL scale the logits). At T = 0.7
    # with T = 1 log-probabilities, pushing down wrong answers' (likely) tokens flattened
    # the policy: entropy 1.3 -> 2.4 and held-out accuracy 0.15 -> 0.06 in 5 iterations.
    temperature: float = 1.0

    @staticmethod
    def of(
        rollout, advantages: torch.Tensor, informative: torch.Tensor, temperature: float = 1.0
    ) -> PolicyBatch:
        """A rollout's sequences (prompt + response), with their [prompt, sample] advantages
        and whether their group is informative."""
        batch = PolicyBatch([], [], [], [], temperature)
        for g, prompt in enumerate(rollout.prompt_ids):
            for s, response in enumerate(rollout.responses[g]):
                batch.token_ids.append(prompt + response)
                batch.prompt_lens.append(len(prompt))
                batch.advantages.append(float(advantages[g, s]))
                batch.informative.append(bool(informative[g]))
        return batch


@dataclass
class PolicyRound:
    """What one policy update did, over the whole batch (every rank returns the same)."""

    sequences: int  # those of informative groups: the surrogate's
    entropy: float  # the rollout policy's mean token entropy at T = 1
    version: int  # the policy's, after the update
    steps: int = 0
    means: dict[str, float] = field(default_factory=dict)  # the last epoch's loss terms, grad norm

    def record(self) -> dict:
        """As the job's metrics records name them (`policy_*`)."""
        counts = {
            "sequences": self.sequences,
            "steps": self.steps,
            "entropy": self.entropy,
            "version": self.version,
        }
        return {f"policy_{k}": v for k, v in (self.means | counts).items()}


def response_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log p(x_{t+1} | x_<=t) aligned with position t+1: [B, T] (position 0 is 0), of the
    distribution at `temperature`."""
    scaled = logits[:, :-1].float() / temperature
    logp = torch.log_softmax(scaled, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(logp, (1, 0))


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """The entropy at T = 1 of the distribution each position samples its next token from,
    aligned like `response_logprobs` (the entropy behind position t+1's token at t+1)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0))


def _response_mask(ids_mask: torch.Tensor, prompt_lens: list[int]) -> torch.Tensor:
    mask = ids_mask.clone().bool()
    for i, p in enumerate(prompt_lens):
        mask[i, :p] = False
    return mask


class PolicyLearner:
    """The policy and its optimiser. As rank `rank` of `world` (after `join`), it handles a
    contiguous shard of each batch; the ranks' gradients are summed, and the parameters,
    gradients and optimiser state are sharded over them with `policy.sharding: fsdp`
    (see sharding.py). Publishing and checkpoints gather the whole model to rank 0."""

    def __init__(
        self,
        model_dir: str,
        cfg: PolicySettings,
        device: str = "cpu",
        dtype: str = "float32",
        seed: int = 0,
        aux_layers: tuple[int, ...] = (),
    ):
        torch.manual_seed(seed)
        self.model_dir, self.cfg, self.device = model_dir, cfg, torch.device(device)
        self.aux_layers = tuple(aux_layers)  # the layers an EAGLE-3 draft reads
        self.autocast = autocast_dtype(cfg.autocast, self.device)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype)
        ).to(self.device)
        self.model.config.use_cache = False
        if cfg.activation_checkpointing:
            self.model.gradient_checkpointing_enable({"use_reentrant": False})
        self.opt = self._optimizer()
        self.ref = None
        if cfg.kl_coef > 0:
            self.ref = (
                AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
                .to(self.device)
                .eval()
            )
        self.version = 0
        self.rank, self.world = 0, 1
        self._batch: PolicyBatch | None = None
        self._shard: range = range(0)
        self._old_logp: dict[int, torch.Tensor] = {}
        self._ref_logp: dict[int, torch.Tensor] = {}
        self._entropy: dict[str, float] = {}

    def rendezvous(self) -> str:
        """Rank 0: an address on this node for the ranks to meet at."""
        import ray

        return sharding.rendezvous_address(ray.util.get_node_ip_address())

    def join(self, address: str, rank: int, world: int, timeout_s: float = 1800.0) -> None:
        """Join the other ranks, and put the models on FSDP2 over them (before any step:
        the optimiser is made anew, for the sharded parameters)."""
        sharding.join(address, rank, world, self.device, timeout_s)
        self.rank, self.world = rank, world
        sharding.distribute(self.model, self.cfg.sharding, self.device)
        if self.ref is not None:
            sharding.distribute(self.ref, self.cfg.sharding, self.device)
        self.opt = self._optimizer()

    def _optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.model.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay
        )

    def _forward(self, model, ids: torch.Tensor, mask: torch.Tensor, aux_layers=()):
        if self.autocast is None:
            return forward_with_hidden(model, ids, mask, aux_layers)
        with torch.autocast(self.device.type, dtype=self.autocast):
            return forward_with_hidden(model, ids, mask, aux_layers)

    def _micro_batches(self, indices: list[int]):
        """(batch indices, ids, mask) of this rank's micro-batches. Under several ranks,
        as many as the rank with the most has: FSDP's collectives run inside every forward
        and backward, so a rank that has run out takes one-token passes (no indices)."""
        size = self.cfg.micro_batch
        count = -(-len(indices) // size)
        if self.world > 1:
            count = sharding.max_over_ranks(count, self.device)
        for start in range(0, count * size, size):
            idx = indices[start : start + size]
            if idx:
                ids, mask = pad_batch([self._batch.token_ids[i] for i in idx])
            else:
                ids = mask = torch.ones(1, 1, dtype=torch.long)
            yield idx, ids.to(self.device), mask.to(self.device)

    @torch.no_grad()
    def prepare(self, batch: PolicyBatch) -> DraftData:
        """The forward GRPO needs anyway, over this rank's shard: rollout-time log-probs for
        the surrogate, and the last-layer hidden states of the same pass for the draft."""
        self.model.eval()
        self._batch = batch
        self._shard = sharding.shard(len(batch.token_ids), self.rank, self.world)
        self._old_logp, self._ref_logp, seqs = {}, {}, []
        self._entropy = {"entropy_sum": 0.0, "entropy_tokens": 0.0}
        for idx, ids, mask in self._micro_batches(list(self._shard)):
            hidden, logits, aux = self._forward(self.model, ids, mask, self.aux_layers)
            ref_logits = self._forward(self.ref, ids, mask)[1] if self.ref is not None else None
            if not idx:
                continue
            resp = _response_mask(mask, [batch.prompt_lens[i] for i in idx])
            self._entropy["entropy_sum"] += float(token_entropy(logits)[resp].sum())
            self._entropy["entropy_tokens"] += float(resp.sum())
            temperature = batch.temperature
            self._old_logp |= dict(
                zip(idx, response_logprobs(logits, ids, temperature).cpu(), strict=True)
            )
            if self.ref is not None:
                self._ref_logp |= dict(
                    zip(idx, response_logprobs(ref_logits, ids, temperature).cpu(), strict=True)
                )
            for row, i in enumerate(idx):
                n = len(batch.token_ids[i])
                # In the dtype the policy computed them (bfloat16 for a bfloat16 policy: half
                # what float32 would ship); the prompt's too, which the head attends over
                # as vLLM's drafter does.
                hidden_row = hidden[row, :n].detach().cpu()
                aux_row = aux[row, :n].detach().cpu() if aux is not None else None
                seqs.append(Sequence(batch.token_ids[i], batch.prompt_lens[i], hidden_row, aux_row))
        # The draft pairs with the embedding and lm_head the engine will serve, which each
        # policy update changes: rank 0 sends them every iteration, in the policy's dtype.
        embed, lm_head = (
            sharding.full_tensor(module.weight.detach())
            for module in (self.model.get_input_embeddings(), self.model.get_output_embeddings())
        )
        if self.rank != 0:
            return DraftData(seqs, None, None, self.version)
        return DraftData(seqs, embed.cpu(), lm_head.cpu(), self.version)

    def update(self) -> PolicyRound:
        """One GRPO step (per epoch) on the prepared rollout; groups without reward variance
        are skipped. Every rank returns the same statistics (of the whole batch)."""
        batch = self._batch
        chosen = [i for i, keep in enumerate(batch.informative) if keep]
        entropy = self._entropy
        if self.world > 1:
            entropy = sharding.all_reduce_sums(entropy, list(entropy), self.device)
        # The rollout policy's mean token entropy at T = 1 over every response (verl's
        # actor/entropy): a sharpening policy's falls.
        mean_entropy = entropy["entropy_sum"] / max(entropy["entropy_tokens"], 1.0)
        done = PolicyRound(len(chosen), mean_entropy, self.version)
        if not chosen:
            return done
        mine = [i for i in chosen if i in self._shard]
        self.model.train()
        total_tokens = sum(len(batch.token_ids[i]) - batch.prompt_lens[i] for i in chosen)
        # Replicas all-reduce their gradients once a step; shards reduce-scatter each
        # micro-batch's, so that no rank ever holds a whole gradient.
        sync_each = self.cfg.sharding == "fsdp"
        for _ in range(self.cfg.epochs):
            self.opt.zero_grad(set_to_none=True)
            sums: dict[str, float] = {}
            micro_batches = list(self._micro_batches(mine))
            for n, (idx, ids, mask) in enumerate(micro_batches):
                if sharding.is_distributed(self.model):
                    self.model.set_requires_gradient_sync(sync_each or n == len(micro_batches) - 1)
                logits = self._forward(self.model, ids, mask)[1]
                if not idx:
                    (logits.sum() * 0).backward()
                    continue
                logp = response_logprobs(logits, ids, batch.temperature)
                old = _stack_padded([self._old_logp[i] for i in idx], logp.shape[1]).to(self.device)
                ref = (
                    _stack_padded([self._ref_logp[i] for i in idx], logp.shape[1]).to(self.device)
                    if self.ref is not None
                    else None
                )
                resp = _response_mask(mask, [batch.prompt_lens[i] for i in idx])
                adv = torch.tensor([batch.advantages[i] for i in idx], device=self.device)
                loss, mb = grpo_loss(
                    logp,
                    old,
                    adv,
                    resp,
                    self.cfg.clip_eps,
                    ref_logp=ref,
                    kl_coef=self.cfg.kl_coef,
                    aggregation=self.cfg.aggregation,
                )
                # Micro-batch means, weighted back into a mean over the whole batch.
                share = (
                    int(resp.sum()) / total_tokens
                    if self.cfg.aggregation == "token_mean"
                    else len(idx) / len(chosen)
                )
                (loss * share).backward()
                for k, v in mb.items():
                    sums[k] = sums.get(k, 0.0) + v * share
            if self.world > 1:
                names = loss_stat_names(kl=self.ref is not None)
                sums = sharding.all_reduce_sums(sums, names, self.device)
            norm = sharding.full_tensor(
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            )
            if not torch.isfinite(norm):
                raise FloatingPointError(
                    f"policy gradient norm is {float(norm)}; stopping before the weights change"
                )
            self.opt.step()
            done.means = sums | {"grad_norm": float(norm)}
            done.steps += 1
        self.version += 1
        done.version = self.version
        return done

    def export_weights(self, dtype: str) -> dict[str, torch.Tensor] | None:
        """Weights under the checkpoint's names and dtype, as the engine's manifest expects,
        on rank 0 (None on the others, which must all be asked too: under FSDP each
        parameter is gathered from every rank, one at a time, so rank 0 never holds the
        whole model twice)."""
        weights = {}
        for name, value in untied(self.model, self.model.state_dict()).items():
            whole = sharding.full_tensor(value.detach())
            if self.rank == 0:
                weights[name] = whole.to(getattr(torch, dtype)).cpu().contiguous()
        return weights if self.rank == 0 else None

    def save(self, path: Path) -> None:
        """The policy's part of checkpoint `path` (policy_checkpoint.py): rank 0 writes the
        whole model and optimiser state, and every rank must be asked."""
        save_policy(path, self.model, self.opt, self.rank, self.version, self.model_dir)

    def load(self, path: Path) -> None:
        """Continue from a checkpoint folder written by `save`, by any number of ranks."""
        self.version = load_policy(path, self.model, self.opt, self.rank)

    def status(self) -> dict:
        return {"version": self.version, "rank": self.rank, "world": self.world}

    def shutdown(self) -> None:
        sharding.leave()


def _stack_padded(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r[:width]
    return out


class JobDraftLearner(DraftLearner):
    """The job's draft learner: built again by Ray after its process died, it resumes from
    the newest complete checkpoint in `checkpoints`."""

    def __init__(
        self,
        policy_dir: str,
        init: str | None,
        cfg: DraftTrainConfig,
        device: str,
        seed: int,
        checkpoints: str,
        new_head_kind: str,
    ):
        latest = latest_checkpoint(Path(checkpoints))
        super().__init__(policy_dir, init, cfg, device, seed, new_head_kind, resume_from=latest)
