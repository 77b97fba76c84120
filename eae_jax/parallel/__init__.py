"""Scale-out on JAX's SPMD machinery: meshes, logical-axis sharding rules, FSDP
and tensor parallelism inside the reconstructed scan, a GPipe pipeline over
stages, multi-host start-up (see docs/scale-out.md)."""

from eae_jax.parallel.fsdp import constrain, gather_block, map_specs
from eae_jax.parallel.lm import BLOCK_LOGICAL_AXES, lm_logical_axes, lm_param_shardings, opt_state_shardings
from eae_jax.parallel.mesh import AXES, format_mesh, make_mesh, mesh_size, parse_mesh
from eae_jax.parallel.pipeline import bubble_fraction, gpipe, relocate_pass
from eae_jax.parallel.rules import LOGICAL_AXIS_RULES, logical_to_spec, tree_shardings, tree_specs, without_axes
from eae_jax.parallel.storage import Sharded, storage_for_mesh

__all__ = [
    "AXES", "BLOCK_LOGICAL_AXES", "LOGICAL_AXIS_RULES", "Sharded", "bubble_fraction", "constrain", "format_mesh",
    "gather_block", "gpipe", "lm_logical_axes", "lm_param_shardings", "logical_to_spec", "make_mesh", "map_specs",
    "mesh_size", "opt_state_shardings", "parse_mesh", "relocate_pass", "storage_for_mesh", "tree_shardings",
    "tree_specs", "without_axes",
]
