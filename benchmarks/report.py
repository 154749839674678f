"""What every benchmark does with its results: JSON for machines, a PNG for people."""
import json
import os


def write(results: dict, json_path: str | None, plot=None, plot_path: str | None = None) -> None:
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)
    if plot_path:
        os.makedirs(os.path.dirname(os.path.abspath(plot_path)), exist_ok=True)
        plot(results, plot_path)
