import logging
import sys
import warnings

warnings.filterwarnings("ignore")
logging.getLogger("transformers").setLevel(logging.ERROR)

from engine.cli import main  # noqa: E402

sys.exit(main())
