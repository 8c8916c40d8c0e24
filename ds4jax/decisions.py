"""The discrete choices one layer makes over a band: which experts each token is routed to, which compressed rows
each query's indexer keeps. The qualification pins a configuration to the exact path's choices, so that what it
compares is arithmetic, not a near-tie that happened to flip (docs/model.md §13).
"""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Decisions:
  route_ids: jax.Array                    # [B, K] int32 experts of each token (hash layers: the table's)
  index_rows: jax.Array | None = None     # [B, k] int32 rows each query keeps (CSA layers; -1 = none)
  route_scores: jax.Array | None = None   # [B, E] f32 selection scores (score + bias), when recorded
  index_scores: jax.Array | None = None   # [B, R] f32 indexer scores (-inf = not visible), when recorded
