"""Per-process memory accounting: :func:`verify`, :class:`MemoryReport`, :func:`measure`.

``_process``: what the kernel says of one process; ``_dataset``: what a dataset holds;
``_verify``: running the loader, alone or across local ranks; ``_report``: from the
measurements to the copies and the verdict; ``_plot``: the report as a bar chart.
"""

from ._process import ProcessMemory, measure
from ._report import MemoryReport
from ._verify import verify

__all__ = ["MemoryReport", "ProcessMemory", "measure", "verify"]
