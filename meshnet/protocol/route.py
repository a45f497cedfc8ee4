"""Routes and hops: the one type and the one JSON form, shared by the tracker and entry nodes.

A route is an ordered list of hops covering a model's layers; each hop names the node and the
layers it runs (a sub-range of its shard, ADR-0012). Inside meshnet a hop holds a half-open
:class:`meshnet.layers.LayerRange`; its JSON form (``GET /v1/route``, the ``meshnet`` block of
a chat response) has inclusive ``start_layer``/``end_layer`` (ADR-0002). A route asked for a
session carries the tracker's session ticket for it (ADR-0038, :mod:`meshnet.protocol.tickets`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from meshnet.protocol.ids import NodeId
from meshnet.layers import LayerRange, check_inclusive_end


#: the path under which a relay exposes the nodes it relays (ADR-0045)
RELAY_PATH = "/v1/relay/"


@dataclass(frozen=True)
class Hop:
    """One step of a route: ``node_id`` at ``endpoint`` runs ``layers`` (half-open)."""

    node_id: NodeId
    endpoint: str
    layers: LayerRange

    @property
    def relayed(self) -> bool:
        """Whether the hop is reached through a relay's tunnel (its endpoint is
        ``{relay}`` + :data:`RELAY_PATH` + ``{node_id}``, ADR-0045)."""
        return RELAY_PATH in self.endpoint

    def to_json(self) -> dict:
        """The public JSON form: ``{node_id, endpoint, start_layer, end_layer}`` (inclusive)."""
        start, end = self.layers.to_inclusive()
        return HopJSON(node_id=self.node_id, endpoint=self.endpoint, start_layer=start, end_layer=end).model_dump()

    @classmethod
    def from_json(cls, data: "dict | HopJSON") -> "Hop":
        """Parse the public JSON form.

        Raises:
            pydantic.ValidationError: a field missing or of the wrong type, or a reversed range.
        """
        hop = data if isinstance(data, HopJSON) else HopJSON.model_validate(data)
        return cls(hop.node_id, hop.endpoint, LayerRange.from_inclusive(hop.start_layer, hop.end_layer))


class HopJSON(BaseModel):
    """A hop on the wire (inclusive layers)."""

    model_config = ConfigDict(extra="forbid")
    node_id: str = Field(min_length=1)
    endpoint: str = Field(min_length=1)
    start_layer: int = Field(ge=0)
    end_layer: int = Field(ge=0)

    @field_validator("end_layer")
    @classmethod
    def _order(cls, value: int, info: ValidationInfo) -> int:
        return check_inclusive_end(info.data.get("start_layer", 0), value, "start_layer", "end_layer")


@dataclass(frozen=True)
class Route:
    """The hops of one session's remote layers, in order, the ticket that lets the entry use
    them (None: a mesh without tickets, e.g. nodes that have no tracker), and whether the tracker
    verified every shard of the session's route, the entry's own included (ADR-0069; None: not
    said, a route from no tracker)."""

    hops: list[Hop]
    ticket: str | None = None
    verified: bool | None = None


class RouteResponse(BaseModel):
    """Body of ``GET /v1/route``: the hops serving the asked layers of ``model``, in order,
    (when the route was asked for a ``session``) the session's ticket, and the hops that no
    second holder could check (``unverified``)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    hops: list[HopJSON]
    ticket: str | None = None
    #: node ids of hops whose layers no other admitted holder covers: nothing can spot-check
    #: them (ADR-0042)
    unverified: list[str] = Field(default_factory=list)
    #: every hop runs on a shard the tracker verified against another holder, or that the operator
    #: trusts (and, for a session's route, the entry's own shard too); False when one was admitted on
    #: its holder's word alone (ADR-0069)
    verified: bool = False

    def to_hops(self) -> list[Hop]:
        """The hops as :class:`Hop` (half-open layers)."""
        return [Hop.from_json(h) for h in self.hops]

    def to_route(self) -> Route:
        """The hops, the ticket and whether they are verified."""
        return Route(self.to_hops(), self.ticket, self.verified)
