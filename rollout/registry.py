"""MLflow model registry for drafter heads: one registered model per target and endpoint.

The registry is the source of truth for what serves: the version the alias
``champion`` points at. The version it replaced keeps the alias ``previous``, and
the stage ``Production`` is kept on the champion for tools that still read stages
(MLflow 3 deprecates stages in favour of aliases, and still supports them).

A registry without stages (Unity Catalog: ``[mlflow] stages = "auto"`` detects its
``databricks-uc`` registry URI, ``"off"`` says so for any other) keeps the aliases alone;
everything below then reads and moves the aliases only. The registry is
``[mlflow] registry_uri`` (``MLFLOW_REGISTRY_URI``), else the tracking server.

A person may move either one, in the MLflow UI or through the API: moving
``champion`` back to an older version, or that version to ``Production``, is a
rollback. :meth:`Registry.sync` decides which one moved against the version it last
synced (a tag on the registered model) and moves the other to match; when both
moved since, the alias wins.

Every candidate is one run tagged with its cycle id, and at most one model version
per run, so looking them up by tag makes registration idempotent.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

from settings.config import Config

log = logging.getLogger(__name__)

PRODUCTION = "Production"
ALIAS = "champion"
PREVIOUS_ALIAS = "previous"
# Registered-model tag: the champion version the alias and the stage last agreed on (see Registry.sync).
T_SYNCED = "adapt.champion_synced"
HEAD_ARTIFACT = "head"

# Tag keys (runs and model versions).
T_CYCLE = "adapt.cycle_id"
T_SHA = "head_sha256"
T_K = "num_speculative_tokens"
T_PARENT = "parent_version"
T_GATE = "gate_verdict"
# {"<concurrency>": tok/s ratio over serving without speculation}, as JSON, when the bench measured it.
T_SPEEDUP = "speedup_vs_nospec"
# The K per batch size the version's offline acceptance supports ([serving] num_speculative_tokens_per_batch_size).
T_K_SCHEDULE = "proposed_k_per_batch_size"
T_REASON = "gate_reason"
T_PREVIOUS = "adapt.previous_production"
T_SERVED = "adapt.served"  # set once a pool served the version (a later swap back to it is a rollback)


class RegistryError(RuntimeError):
    pass


class Registry:
    """Thin, idempotent wrapper around ``MlflowClient`` for ``cfg.mlflow``."""

    def __init__(self, cfg: Config, tracking_uri: str | None = None) -> None:
        from mlflow.tracking import MlflowClient

        self.cfg = cfg
        self.tracking_uri = tracking_uri or cfg.mlflow.tracking_uri
        # A tracking URI given by the caller with no registry configured: the registry is that server.
        self.registry_uri = cfg.mlflow.registry_uri or self.tracking_uri
        self.stages = cfg.mlflow.model_copy(update={"registry_uri": self.registry_uri}).use_stages()
        self.name = cfg.mlflow.registered_model
        self.client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.registry_uri)

    # -- experiment / model -----------------------------------------------------------

    def experiment_id(self) -> str:
        """The experiment holding this model's candidate runs (same name as the model)."""
        exp = self.client.get_experiment_by_name(self.name)
        if exp is not None:
            return exp.experiment_id
        loc = self.cfg.mlflow.artifact_location or None
        if loc and self.tracking_uri.startswith("http"):
            loc = None  # a tracking server proxies artifacts to its own store
        try:
            return self.client.create_experiment(self.name, artifact_location=loc)
        except Exception:  # noqa: BLE001 - created concurrently
            exp = self.client.get_experiment_by_name(self.name)
            if exp is None:
                raise
            return exp.experiment_id

    def ensure_model(self) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(self.name)
        except MlflowException:
            try:
                self.client.create_registered_model(
                    self.name, description="P-EAGLE drafter heads; Production (alias champion) is what serves.")
            except MlflowException:
                self.client.get_registered_model(self.name)  # created concurrently

    # -- runs --------------------------------------------------------------------------

    def find_run(self, cycle_id: str):
        """The candidate run of ``cycle_id`` (any status), or None."""
        runs = self.client.search_runs([self.experiment_id()], f"tags.`{T_CYCLE}` = '{cycle_id}'",
                                       max_results=5, order_by=["attributes.start_time ASC"])
        return runs[0] if runs else None

    def ensure_run(self, cycle_id: str, run_name: str | None = None) -> str:
        """Run id for ``cycle_id``: the existing one, or a new one tagged with it."""
        run = self.find_run(cycle_id)
        if run is not None:
            return run.info.run_id
        run = self.client.create_run(self.experiment_id(), tags={T_CYCLE: cycle_id}, run_name=run_name or cycle_id)
        return run.info.run_id

    # -- versions ----------------------------------------------------------------------

    def version_for_run(self, run_id: str):
        vs = self.client.search_model_versions(f"name = '{self.name}' and run_id = '{run_id}'")
        return min(vs, key=lambda v: int(v.version)) if vs else None

    def register(self, run_id: str, tags: dict[str, Any], model_id: str | None = None,
                 description: str | None = None) -> Any:
        """The model version of ``run_id`` (created once), with ``tags`` set.

        Its source is the run's logged model (``model_id``) when there is one, else the run's
        ``head`` artifact (imported heads).
        """
        self.ensure_model()
        mv = self.version_for_run(run_id)
        if mv is None:
            source = f"models:/{model_id}" if model_id else f"runs:/{run_id}/{HEAD_ARTIFACT}"
            mv = self.client.create_model_version(self.name, source, run_id=run_id, model_id=model_id,
                                                  description=description, tags={k: str(v) for k, v in tags.items()})
        else:
            self.set_tags(mv.version, tags)
            if description is not None:
                self.client.update_model_version(self.name, mv.version, description=description)
        return self.client.get_model_version(self.name, mv.version)

    def set_tags(self, version: str | int, tags: dict[str, Any]) -> None:
        for k, v in tags.items():
            self.client.set_model_version_tag(self.name, str(version), k, str(v))

    def get(self, version: str | int):
        """The model version ``version``; :class:`RegistryError` naming the model and the registry if none."""
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_model_version(self.name, str(version))
        except MlflowException as exc:
            if "RESOURCE_DOES_NOT_EXIST" in str(getattr(exc, "error_code", "")) or "not found" in str(exc).lower():
                raise RegistryError(
                    f"no version {version} of {self.name} in the registry at {self.registry_uri}") from None
            raise

    def versions(self) -> list[Any]:
        from mlflow.exceptions import MlflowException

        try:
            vs = self.client.search_model_versions(f"name = '{self.name}'")
        except MlflowException:
            return []
        return sorted(vs, key=lambda v: int(v.version))

    # -- what serves: the champion alias, the Production stage kept with it -----------

    def _model(self):
        """The registered model, or None before its first version."""
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_registered_model(self.name)
        except MlflowException as exc:
            if "RESOURCE_DOES_NOT_EXIST" in str(getattr(exc, "error_code", "")) or "not found" in str(exc).lower():
                return None
            raise

    def stage_version(self) -> str | None:
        """The version in stage Production (at most one: promotion archives the rest); None on a registry
        without stages."""
        from mlflow.exceptions import MlflowException

        if not self.stages:
            return None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                vs = self.client.get_latest_versions(self.name, stages=[PRODUCTION])
        except MlflowException as exc:
            if "RESOURCE_DOES_NOT_EXIST" in str(getattr(exc, "error_code", "")) or "not found" in str(exc).lower():
                return None
            raise
        return str(vs[0].version) if vs else None

    def aliases(self) -> dict[str, str]:
        """Every alias of the registered model and its version ({} before the first version)."""
        model = self._model()
        return {k: str(v) for k, v in (getattr(model, "aliases", None) or {}).items()} if model is not None else {}

    def alias_version(self, alias: str = ALIAS) -> str | None:
        return self.aliases().get(alias)

    def _read(self) -> tuple[str | None, str | None, str | None, bool]:
        """One read of the champion alias, the Production stage and the last synced version (and whether
        the model exists): everything a decision takes comes from the same read."""
        model = self._model()
        if model is None:
            return None, None, None, False
        alias = {k: str(v) for k, v in (getattr(model, "aliases", None) or {}).items()}.get(ALIAS)
        synced = (getattr(model, "tags", None) or {}).get(T_SYNCED)
        return alias, self.stage_version(), synced, True

    @staticmethod
    def _decide(alias: str | None, stage: str | None, synced: str | None) -> tuple[str | None, str]:
        """The champion version and which side decided it: "alias", "stage" or "agreed"."""
        if alias == stage:
            return alias, "agreed"
        if alias is None:
            return stage, "stage"
        if stage is None:
            return alias, "alias"
        # They disagree: the one still on the last synced version did not move.
        if alias == synced:
            return stage, "stage"
        return alias, "alias"  # the alias moved, or both did: MLflow 3's mechanism wins

    def _resolve(self) -> tuple[str | None, str]:
        """The champion version and which side decided it (read-only)."""
        alias, stage, synced, exists = self._read()
        return self._decide(alias, stage, synced) if exists else (None, "agreed")

    def champion(self):
        """The model version that serves (``champion``, or the Production stage where a person moved it since
        the last :meth:`sync`), or None. Read-only."""
        version, _ = self._resolve()
        return self.get(version) if version is not None else None

    def production(self):
        """The serving version, as :meth:`champion` (the name predates the alias)."""
        return self.champion()

    def sync(self) -> dict[str, Any] | None:
        """Bring the alias and the stage together on the champion; returns what moved, or None if nothing did.

        A moved alias moves the stage (archiving the rest), a moved stage moves the alias; either way the
        version they left keeps the ``previous`` alias and is recorded on the new one (``T_PREVIOUS``), so an
        automatic rollback knows where to go."""
        return self.sync_champion()[1]

    def sync_champion(self) -> tuple[str | None, dict[str, Any] | None]:
        """:meth:`sync`, and the champion it decided on that same read (None: nothing serves).

        What serves must be what the sync acted on: a champion read again afterwards can see a person's
        move made in between, and a pool that followed it before the alias did would leave that person
        moving the alias back to the version it still names, a change that is no change, which the next
        sync then undoes."""
        # Decide and compare on one read: reading the stage again after deciding would see a person's
        # move made in between as a disagreement, and undo it.
        alias, stage, synced, exists = self._read()
        version, side = self._decide(alias, stage, synced) if exists else (None, "agreed")
        if version is None:
            return None, None
        moved: dict[str, Any] = {}
        if self.stages and stage != version:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                self.client.transition_model_version_stage(self.name, version, PRODUCTION,
                                                           archive_existing_versions=True)
            moved["stage"] = {"from": stage, "to": version}
        if alias != version:
            self.client.set_registered_model_alias(self.name, ALIAS, version)
            moved["alias"] = {"from": alias, "to": version}
        # Where the champion came from: the last synced version (what served), else what the other side held.
        before = synced if synced not in (None, version) else (alias if side == "stage" else stage)
        if before not in (None, version):
            self.client.set_registered_model_alias(self.name, PREVIOUS_ALIAS, before)
            self.client.set_model_version_tag(self.name, version, T_PREVIOUS, before)
            moved["previous"] = before
        if synced != version:
            self.client.set_registered_model_tag(self.name, T_SYNCED, version)
        if moved:
            moved.update(version=version, decided_by=side)
            return version, moved
        return version, None

    def promote(self, version: str | int, reason: str = "") -> dict[str, Any]:
        """Make ``version`` the champion: alias ``champion`` and stage Production (archiving the rest); the
        version it replaces keeps the alias ``previous``."""
        version = str(version)
        self.get(version)  # RegistryError for an unknown version
        self.sync()  # a person's move since the last sync counts as what it replaces
        prev_v, _ = self._resolve()
        if prev_v != version:
            if prev_v is not None:
                self.client.set_model_version_tag(self.name, version, T_PREVIOUS, prev_v)
                self.client.set_registered_model_alias(self.name, PREVIOUS_ALIAS, prev_v)
            if self.stages:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    self.client.transition_model_version_stage(self.name, version, PRODUCTION,
                                                               archive_existing_versions=True)
            self.client.set_registered_model_alias(self.name, ALIAS, version)
            self.client.set_registered_model_tag(self.name, T_SYNCED, version)
        if reason:
            self.client.set_model_version_tag(self.name, version, "adapt.promotion_reason", reason)
        return {"version": version, "previous": prev_v}

    def sync_alias(self) -> str | None:
        """:meth:`sync_champion`'s champion version."""
        return self.sync_champion()[0]

    def previous_production(self, version: str | int) -> str | None:
        """The version that served before ``version`` (recorded at promotion or sync), else the ``previous`` alias."""
        prev = self.get(version).tags.get(T_PREVIOUS)
        if prev:
            return prev
        alias = self.alias_version(PREVIOUS_ALIAS)
        return alias if alias != str(version) else None

    def head_uri(self, version: str | int) -> str:
        return f"models:/{self.name}/{version}"

    def download_head(self, version: str | int, dest_dir: str | Path | None = None) -> Path:
        """A local copy of ``version``'s head directory (validated layout: config.json + weights)."""
        from headspec.resolve import resolve_head

        dest = Path(dest_dir or Path(self.cfg.head.heads_dir) / "downloaded")
        path, _ = resolve_head(self.head_uri(version), dest, self.tracking_uri, registry_uri=self.registry_uri)
        if not (path / "config.json").is_file():
            raise RegistryError(f"version {version} has no head directory (looked in {path})")
        return path

    def describe(self, mv: Any, champion: str | None = None, aliases: dict[str, str] | None = None) -> dict[str, Any]:
        """A version as a plain dict. Searched versions carry no aliases in MLflow, so the caller passes the
        model's aliases (:meth:`aliases`) or the ``champion`` alias's version."""
        names = set(getattr(mv, "aliases", []) or [])
        if champion is not None and str(champion) == str(mv.version):
            names.add(ALIAS)
        names |= {a for a, v in (aliases or {}).items() if str(v) == str(mv.version)}
        return {"version": mv.version, "stage": getattr(mv, "current_stage", None) if self.stages else None,
                "run_id": mv.run_id,
                "aliases": sorted(names), "tags": dict(mv.tags or {}),
                "source": mv.source, "created": mv.creation_timestamp}

    def describe_all(self) -> list[dict[str, Any]]:
        """Every version, described (one alias lookup for all)."""
        aliases = self.aliases()
        return [self.describe(mv, aliases=aliases) for mv in self.versions()]


def speedups(tags: dict[str, str]) -> dict[int, float]:
    """A version's measured tok/s ratio over serving without speculation, per concurrency ({} if never measured)."""
    raw = (tags or {}).get(T_SPEEDUP)
    return {int(c): float(x) for c, x in json.loads(raw).items()} if raw else {}


def slower_than_nospec(version: str, tags: dict[str, str]) -> list[str]:
    """Plain sentences for every measured concurrency where the head loses to not speculating."""
    return [f"version {version} was measured slower than serving without speculation at concurrency {c} "
            f"({x:.2f}x): at that load, speculation costs more than it saves"
            for c, x in sorted(speedups(tags).items()) if x < 1.0]


def import_head(cfg: Config, head_dir: str | Path, note: str = "imported") -> Any:
    """Register an existing head directory as a version (idempotent per weights sha256).

    For seeding a registry with the head a pool already serves; its gate verdict
    tag says it was imported, not gated.
    """
    from headspec.validate import validate_head
    from targets.model_zoo import ensure_target

    info = validate_head(head_dir, ensure_target(cfg.target.model, cfg.target.model_cache))
    reg = Registry(cfg)
    run_id = reg.ensure_run(f"import-{info.sha256[:16]}", run_name=f"import-{info.sha256[:12]}")
    run = reg.client.get_run(run_id)
    if reg.version_for_run(run_id) is None:
        reg.client.log_artifacts(run_id, str(info.path), HEAD_ARTIFACT)
        if "head_sha256" not in run.data.params:
            reg.client.log_param(run_id, "head_sha256", info.sha256)
        reg.client.set_terminated(run_id, "FINISHED")
    parent = info.manifest.get("parent")
    return reg.register(run_id, {T_SHA: info.sha256, T_K: info.num_speculative_tokens,
                                 T_PARENT: "none", T_GATE: note, T_REASON: f"{note} from {info.path}",
                                 "parent_sha256": parent or "none"})
