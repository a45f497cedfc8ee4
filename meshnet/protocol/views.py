"""What the tracker shows operators: coverage maps, typed on both ends (the tracker builds them,
the client validates them). Layer numbers are inclusive here (ADR-0002)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class CoverageSegment(BaseModel):
    """Consecutive layers ``start_layer..end_layer`` served by ``node_count`` admitted shards."""

    model_config = ConfigDict(extra="forbid")
    start_layer: int = Field(ge=0)
    end_layer: int = Field(ge=0)
    node_count: int = Field(ge=0)


class Coverage(BaseModel):
    """One model's coverage map. ``routable``: every layer covered and an entry node admitted;
    ``demand``: chat requests refused while not routable, per minute."""

    model_config = ConfigDict(extra="forbid")
    model: str
    num_layers: int = Field(ge=1)
    segments: list[CoverageSegment]
    covered_layers: int = Field(ge=0)
    routable: bool
    demand: float = Field(default=0.0, ge=0)


class CoverageList(BaseModel):
    """Body of ``GET /v1/coverage``: every tracked model's coverage map."""

    model_config = ConfigDict(extra="forbid")
    models: list[Coverage]
