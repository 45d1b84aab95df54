"""``python -m hshare ...`` is the ``hshare`` command (`hshare.cli.main`).

It is what launchers that take a module run, e.g. lm-eval data parallel, one model copy per GPU::

    accelerate launch -m hshare eval --model_args pretrained=<dir or hub id>,hshare=ds@512 --tasks gsm8k
"""

import sys

from hshare.cli import main

if __name__ == "__main__":
    sys.exit(main())
