"""An actor's process imports its own module, not the driver side of the Ray runtime: every actor start
(and every respawn after a failure) pays for what its module pulls in."""

import subprocess
import sys

import pytest

DRIVER_SIDE = ("plait.runtime.ray.runtime", "plait.runtime.ray.planner_actor", "plait.runtime.ray.constructor_actor",
               "plait.runtime.ray.recovery")


@pytest.mark.parametrize("module", ["plait.runtime.ray.loader_actor", "plait.runtime.ray.shadow_actor"])
def test_a_loader_actors_module_leaves_the_driver_side_unimported(module):
    code = f"import sys, {module}; print(','.join(m for m in {DRIVER_SIDE!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == ""


def test_the_package_still_exports_the_runtime_by_name():
    import plait.runtime.ray as ray_runtime
    from plait.runtime.ray import NAMESPACE, RayOptions

    assert NAMESPACE == "plait" and RayOptions.__name__ == "RayOptions" and "RayRuntime" in ray_runtime.__all__
    with pytest.raises(AttributeError):
        ray_runtime.no_such_name  # noqa: B018
