"""Measured costs: each op's latency and kernels on the real device, saved as a profile that
:class:`~opweave.costs.Costs` can be built from (Opara's model profiler, IEEE TC'24 §3.2).

* :mod:`.measure` — :func:`profile_model`: time every op alone, trace its kernels;
* :mod:`.kineto` — kernels of a profiler trace, by the op that launched them;
* :mod:`.occupancy` — blocks per SM, occupancy, an op's resource demand and utilization, category checks;
* :mod:`.store` — :class:`Profile`, its key and JSON file, refused when measured for something else.
"""

from opweave.costs.profile.measure import full_env, profile_model
from opweave.costs.profile.store import Profile, ProfileKeyError, device_name, load_for, profile_key

__all__ = ["Profile", "ProfileKeyError", "device_name", "full_env", "load_for", "profile_key", "profile_model"]
