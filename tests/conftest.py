import pathlib
import sys

# Test helpers (tests/official.py, tests/model/reference_models.py) import by module name.
HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "model"))
