"""One weight update through vLLM 0.32's lifecycle, whoever drives it.

    start_weight_update()            # or start_draft_weight_update() for the draft head
    update_weights({"path", "version"})
    finish_weight_update(version)    # the engine-level version is the policy's

A session that a trainer which died left open is ended first, its load undone; one a live
trainer holds is an error naming it. A load that failed on any rank is undone on all
(`grpo_abort_weight_update`) before the error is raised, so that no rank serves half a
model of new weights. Resetting the prefix cache afterwards is the caller's, since each
reports a failed reset its own way.

The transports of control differ, the lifecycle does not (`clients`, one per transport):
the trainer's `ShmTrainerEngine` (`trainer`) runs it through a client of an `LLM`, of a
`vllm serve` or of a `collective_rpc`; the served route `POST /v1/grpo/weights`
(`endpoint`) through `AsyncEngineClient`.
"""

from __future__ import annotations

from typing import Any, Literal

Role = Literal["policy", "draft"]


def run_update(client, role: Role, update_info: dict[str, Any], version: int) -> None:
    """Load `update_info` (the backend's: for `grpo_shm`, the swap file's path and version)
    as `role`'s weights through `client`, a `VLLMWeightSyncClient` with the plugin's
    `start_draft_weight_update`, `abort_weight_update` and `end_stale_weight_update`."""
    _start(client, role)
    try:
        client.update_weights(update_info)
    except BaseException:
        client.abort_weight_update()
        raise
    client.finish_weight_update(None if role == "draft" else str(version))


def _start(client, role: Role) -> None:
    start = client.start_draft_weight_update if role == "draft" else client.start_weight_update
    try:
        start()
    except Exception as err:
        # vLLM refuses a start while a session is open ("already active"; over HTTP only a
        # status 500 says so): ask the engine whether its session is stale.
        ended = client.end_stale_weight_update()
        if not ended["ended"]:
            raise RuntimeError(
                f"could not open a weight update session ({err}); the engine says: "
                f"{ended['reason']}"
            ) from err
        start()


def merged_session_ends(per_rank: list[dict]) -> dict:
    """One answer for all ranks to `grpo_end_stale_weight_update`: ended where every rank
    ended its session."""
    return {
        "ended": all(r["ended"] for r in per_rank),
        "reason": "; ".join(sorted({r["reason"] for r in per_rank})),
    }
