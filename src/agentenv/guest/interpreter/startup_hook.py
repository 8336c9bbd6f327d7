"""Runs inside every python kernel at start (ipykernel `exec_files`), not in the server.

It registers the display formatters the SDK's `Result` reads, as upstream's IPython startup
scripts do: `e2b/chart` (a matplotlib Figure's data, extracted by the `e2b_charts` package the
upstream template installs) and `e2b/data` (a pandas DataFrame as columns). With the inline
matplotlib backend every shown or trailing figure is displayed, so each one yields a result with
`png` and `chart`. Everything lives inside one function that deletes itself, because this file
runs in the user's namespace.
"""


def _agentenv_install_formatters() -> None:
    import sys
    from typing import Any

    from IPython import get_ipython
    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    class ChartFormatter(BaseFormatter):
        """A matplotlib Figure -> e2b chart dict; `{}` (dropped) when it is not a chart."""

        format_type = Unicode("e2b/chart")
        print_method = ObjectName("_repr_e2b_chart_")
        _return_type = (dict, str)

        def __call__(self, obj: Any) -> Any:
            if "matplotlib" not in sys.modules:
                return super().__call__(obj)
            from matplotlib.figure import Figure

            if not isinstance(obj, Figure):
                return super().__call__(obj)
            try:
                from e2b_charts import chart_figure_to_dict  # type: ignore[import-untyped]

                return chart_figure_to_dict(obj)
            except Exception:
                return {}

    class DataFormatter(BaseFormatter):
        """A pandas DataFrame -> {column: [values]}, timestamps as ISO strings."""

        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict, str)

        def __call__(self, obj: Any) -> Any:
            pandas = sys.modules.get("pandas")
            if pandas is None or not isinstance(obj, pandas.DataFrame):
                return super().__call__(obj)
            columns: dict[Any, list[Any]] = obj.to_dict(orient="list")
            return {
                key: [v.isoformat() if isinstance(v, pandas.Timestamp) else v for v in values]
                for key, values in columns.items()
            }

    shell = get_ipython()
    if shell is None:
        return
    formatters = shell.display_formatter.formatters
    formatters["e2b/chart"] = ChartFormatter(parent=shell.display_formatter)
    formatters["e2b/data"] = DataFormatter(parent=shell.display_formatter)


_agentenv_install_formatters()
del _agentenv_install_formatters
