"""A task: one workload on one target, with its template and config space."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from farm.core.space import Config, ConfigSpace
from farm.core.targets import TargetSpec, parse_target
from farm.core.templates import Template, get_template
from farm.core.workloads import Workload, workload_from_json


@dataclass(frozen=True)
class Task:
    """What one tuning task searches: `workload` scheduled by its template for `target`."""

    workload: Workload
    target: TargetSpec

    @cached_property
    def template(self) -> Template:
        return get_template(self.workload, self.target)

    @cached_property
    def space(self) -> ConfigSpace:
        return self.template.space(self.workload, self.target)

    def default_config(self) -> Config:
        """The template's fallback: the first config, in index order, that passes its check."""
        for index in range(min(self.space.size, 1_000_000)):
            config = self.space.get(index)
            if self.check(config) is None:
                return config
        raise RuntimeError(f"{self.template.name} has no valid config for {self}")

    def check(self, config: Config) -> str | None:
        """None if the config passes the template's pre-build validity check, else why not."""
        return self.template.check(self.workload, self.target, config)

    def precheck(self, config: Config) -> str | None:
        """The template's cheap necessary condition of `check` (`Template.precheck`)."""
        return self.template.precheck(self.workload, self.target, config)

    def schedule(self, config: Config) -> Any:
        return self.template.schedule(self.workload, self.target, config)

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
        """A task the farm stored or sent (`to_json`, or a task row's workload and target)."""
        return cls(workload_from_json(doc["workload"]), parse_target(doc["target"]))

    def __str__(self) -> str:
        return f"{self.workload} on {self.target}"
