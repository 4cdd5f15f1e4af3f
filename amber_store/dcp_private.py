"""The private names of torch.distributed.checkpoint that :mod:`amber_store.dcp` uses, in one
place: a torch release that moves or renames one breaks this module's import, not call sites
spread through the adapter. Checked with the torch releases in :data:`TORCH_CHECKED` (the tests
pin one; a test fails on any other until these names are checked against it again).

- ``unflatten_state_dict``, ``set_element``: DCP's own unflattening of a flattened state dict,
  which the state a sharded step opens as must match key for key.
- ``EmptyStateDictLoadPlanner``, ``load_state_dict``: DCP's load of a checkpoint into an empty
  state, without a process group (as torch's ``format_utils.dcp_to_torch_save`` does), which
  ``import_checkpoint`` reads a DCP directory with.
"""

from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner as EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict as load_state_dict

#: torch releases these names were checked against (their signatures and behaviour as used)
TORCH_CHECKED = ("2.13.0",)

__all__ = ["EmptyStateDictLoadPlanner", "TORCH_CHECKED", "load_state_dict", "set_element", "unflatten_state_dict"]
