"""One engine's machinery: the runner and what it uses (launch, readiness, observer, stopping,
output, ladder, engine HTTP). It knows nothing of the policy: commands come in
(``commands``), one ``EngineStatus`` goes out (``status``)."""

from llmsupervisor.engine.commands import Command, Desired, apply
from llmsupervisor.engine.runner import EngineRunner
from llmsupervisor.engine.status import EngineStatus, Incarnation

__all__ = ["Command", "Desired", "EngineRunner", "EngineStatus", "Incarnation", "apply"]
