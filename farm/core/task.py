"""A task: one workload on one target, with its template and config space."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from farm.core.errors import FarmError
from farm.core.space import Columns, Config, ConfigSpace
from farm.core.targets import TargetSpec, parse_target
from farm.core.templates import Template, templates_for
from farm.core.templates.tvm_default import default_schedule
from farm.core.workloads import Workload, workload_from_json

# The baseline's config as trials store it: the schedule a model's build gives a kernel that has
# no tuned record (`Task.baseline_index`).
BASELINE: dict[str, Any] = {"schedule": "tvm-default"}


@dataclass(frozen=True)
class Task:
    """What one tuning task searches: `workload` scheduled by a template for `target`: the one
    named `template_name`, or the first of `templates_for` (a TIR kernel whose main computation is
    one of the farm's operators: that operator's hand template before its design space)."""

    workload: Workload
    target: TargetSpec
    template_name: str | None = None

    @cached_property
    def _scheduled(self) -> tuple[Workload, Template]:
        options = templates_for(self.workload, self.target)
        if self.template_name is None:
            return options[0]
        for option in options:
            if option[1].name == self.template_name:
                return option
        names = ", ".join(t.name for _, t in options)
        raise FarmError(f"template {self.template_name} does not schedule {self.workload} on {self.target.kind}; "
                        f"these do: {names}")

    @property
    def template(self) -> Template:
        return self._scheduled[1]

    @property
    def scheduled_as(self) -> Workload:
        """The workload the template schedules: the task's own, or the farm operator a TIR kernel
        computes (farm.core.fused.FusedOperator)."""
        return self._scheduled[0]

    @cached_property
    def space(self) -> ConfigSpace:
        return self.template.space(self.scheduled_as, self.target)

    @property
    def baseline_index(self) -> int:
        """The index of the task's baseline, one past the space's last config: the workload's
        function as TVM schedules it untuned (`templates.tvm_default.default_schedule`: DLight's rules on
        GPUs, as a model's build schedules a kernel it has no record of). A task's first candidate
        (`SearchStrategy.baseline`), so that a kernel whose template cannot beat TVM's own schedule
        keeps that schedule, as the fastest record of the task, instead of a slower one."""
        return self.space.size

    def config(self, index: int) -> Config:
        """Config `index` of the space, or the baseline (`baseline_index`). IndexError beyond."""
        if index == self.baseline_index:
            return Config(index, tuple(BASELINE.items()))
        return self.space.get(index)

    def config_from_json(self, doc: dict[str, Any]) -> Config:
        """The config a trial stored as `doc` (`Config.to_json`); FarmError where it is not one of
        the space's (`ConfigSpace.from_json`) or the baseline."""
        return self.config(self.baseline_index) if doc == BASELINE else self.space.from_json(doc)

    def is_baseline(self, config: Config) -> bool:
        return config.index == self.baseline_index

    def default_config(self) -> Config:
        """The template's fallback: the first config, in index order, that passes its check."""
        for index in range(min(self.space.size, 1_000_000)):
            config = self.space.get(index)
            if self.check(config) is None:
                return config
        raise RuntimeError(f"{self.template.name} has no valid config for {self}")

    def check(self, config: Config) -> str | None:
        """None if the config passes the template's pre-build validity check, else why not (the
        baseline's is its build)."""
        if self.is_baseline(config):
            return None
        return self.template.check(self.scheduled_as, self.target, config)

    def precheck(self, config: Config) -> str | None:
        """The template's cheap necessary condition of `check` (`Template.precheck`)."""
        if self.is_baseline(config):
            return None
        return self.template.precheck(self.scheduled_as, self.target, config)

    @property
    def prechecks_codes(self) -> bool:
        """Whether the template prechecks many configs at once (`precheck_codes`)."""
        return type(self.template).precheck_columns is not Template.precheck_columns

    def precheck_codes(self, codes: np.ndarray) -> np.ndarray | None:
        """`precheck` of the configs given as codes (one value position per knob of the space, as
        the search's featurizer has them), True where it passes, all at once where the template
        has such a form (`Template.precheck_columns`); None where it has not."""
        if not self.prechecks_codes:
            return None
        return self.template.precheck_columns(self.scheduled_as, self.target, Columns.of_codes(self.space, codes))

    def valid(self, config: Config) -> bool:
        """Whether `config` passes `check`, refused by the template's own `precheck` first where it
        has one: a costly check (a design space's replay) then runs only on configs that pass it.
        Where the precheck is the check itself, the check runs once."""
        if type(self.template).precheck is not Template.precheck and self.precheck(config) is not None:
            return False
        return self.check(config) is None

    def schedule(self, config: Config) -> Any:
        """The `s_tir.Schedule` of `config`: the template's, or the baseline's of the task's own
        workload."""
        if self.is_baseline(config):
            return default_schedule(self.workload, self.target)
        return self.template.schedule(self.scheduled_as, self.target, config)

    @property
    def key(self) -> str:
        """Identity of the task: workload, target, template and template version."""
        return json.dumps(self.to_json(), sort_keys=True)

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload.to_json(),
            "target": self.target.to_json(),
            "template": self.template.name,
            "template_version": self.template.version,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Task:
        """A task the farm stored or sent (`to_json`, or a task row: workload, target, template)."""
        return cls(workload_from_json(doc["workload"]), parse_target(doc["target"]), doc.get("template"))

    def __str__(self) -> str:
        return f"{self.workload} on {self.target}"
