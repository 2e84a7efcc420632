#!/bin/bash
# call 1 (fresh one-GPU machine): GPU suite first? no: cold compiles first, alone on the host.
cd "$(dirname "$0")/../.."
nvidia-smi -L; nproc; date
bash .anchor/dyn/dyn_gpu.sh cold 2>&1 | tail -60
date
