"""New weights into every running engine, all or none.

Each role's weights are one object in Ray's object store that every engine loads side by
side. When one engine fails, the others get the weights they served before back, so that
no engine serves a version the rest do not; after each iteration the engines' versions
are compared. A failed policy sync stops the job (rollouts from a stale policy would be
wrong); a failed draft sync only slows it (speculation is lossless), so the job goes on
with the previous draft, unless an engine may hold a mix of two drafts.
"""

from __future__ import annotations

import ray

from vllm_plugin.weights.manifest import MixedWeightsError


class WeightSync:
    def __init__(self, engines: list, served: dict, log=print, get=ray.get):
        """`engines`: the rollout actors. `served`: role -> (weights, version, metadata)
        they serve now, what a failed load puts back (needed with several engines only).
        `get`: how a remote call's result is awaited (ray.get; tests pass their own)."""
        self.engines, self.served, self.log, self.get = engines, served, log, get

    def load(self, role: str, weights, version: int, metadata: dict | None = None) -> dict:
        """`role`'s weights into every engine, or none: when one engine fails, the others
        get back what they served and the failure is raised. The slowest load's time is
        reported."""
        loads = [e.load_weights.remote(role, weights, version, metadata) for e in self.engines]
        outcomes = []
        for load in loads:
            try:
                outcomes.append(self.get(load))
            except ray.exceptions.RayTaskError as err:
                outcomes.append(err)
        failures = [o for o in outcomes if isinstance(o, Exception)]
        if failures:
            # An engine whose weights may be a mix refuses to generate: that one is the news.
            failures.sort(key=lambda err: not isinstance(err.cause, MixedWeightsError))
            loaded = [
                e
                for e, o in zip(self.engines, outcomes, strict=True)
                if not isinstance(o, Exception)
            ]
            if loaded:
                try:
                    self.get([e.load_weights.remote(role, *self.served[role]) for e in loaded])
                except ray.exceptions.RayTaskError as err:
                    raise err from failures[0]
            raise failures[0]
        if self.served:
            self.served[role] = (weights, version, metadata)
        return {"total_s": max(o["total_s"] for o in outcomes)}

    def policy(self, weights, version: int, iteration: int, checkpoints) -> dict:
        """The policy's new weights, or a stop: the error says what the engines hold now
        (the previous weights, or, if restoring them failed too, a mix they refuse to
        generate from); the last checkpoint is intact."""
        try:
            return self.load("policy", weights, version)
        except ray.exceptions.RayTaskError as err:
            cause = str(err.cause if err.cause else err).splitlines()[0]
            raise RuntimeError(
                f"iteration {iteration}: policy weight sync (version {version}) failed: {cause}. "
                f"Stopping; resume from {checkpoints} once the cause is fixed."
            ) from err

    def draft(
        self, weights, version: int, metadata: dict, iteration: int
    ) -> tuple[dict, str | None]:
        """The draft's new weights: (load figures, None), or ({}, why) when the engines
        rejected or undid the load and still serve their previous draft."""
        try:
            return self.load("draft", weights, version, metadata), None
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, MixedWeightsError):
                raise  # the engine refuses to generate until a draft loads whole
            why = str(err.cause if err.cause else err).splitlines()[0]
            self.log(f"iteration {iteration}: draft swap failed, keeping the previous draft: {why}")
            return {}, why

    def versions(self) -> dict[str, int]:
        """The weight versions every engine serves; they must agree."""
        versions = self.get([engine.versions.remote() for engine in self.engines])
        if any(v != versions[0] for v in versions):
            raise RuntimeError(f"the engines serve different weight versions: {versions}")
        return versions[0]
