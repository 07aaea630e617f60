"""The job's model names: the project's assets by name (built or prepared on first use),
anything else a folder."""

from __future__ import annotations


def resolve_model(name: str) -> str:
    """'smollm2', 'tiny' and 'smollm2-arith' name the project's assets; anything else is a path."""
    if name == "smollm2":
        from grpo_specdec.assets.smollm2 import prepare_smollm2

        return str(prepare_smollm2())
    if name in ("tiny", "tiny-draft"):
        from grpo_specdec.assets.smollm2 import default_dir
        from grpo_specdec.assets.tiny import build_tiny

        root = default_dir().parent / "tiny"
        if not (root / "draft" / "model.safetensors").is_file():
            build_tiny(root)
        return str(root / ("target" if name == "tiny" else "draft"))
    if name == "smollm2-arith":
        from grpo_specdec.assets.smollm2 import DEFAULT_DRAFT_VOCAB, head_dir
        from grpo_specdec.draft.bootstrap import DraftBootstrapConfig, bootstrap_draft

        out = head_dir()
        if not (out / "model.safetensors").is_file():
            bootstrap_draft(
                DraftBootstrapConfig(
                    target=resolve_model("smollm2"),
                    out=str(out),
                    task="arithmetic",
                    steps=300,
                    draft_vocab=DEFAULT_DRAFT_VOCAB,
                )
            )
        return str(out)
    return name
