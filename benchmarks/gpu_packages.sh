#!/usr/bin/env bash
# The project's packages that the GPU machine's image lacks, installed here into .gpu_packages/ for its Python 3.12
# (x86-64), so that they can be copied there with the working tree when it reaches no package registry. Its image has
# torch, torchvision, lightning, torchmetrics, numpy, PIL, OpenCV, scikit-image and scipy; these are the rest that
# benchmarks/gpu_suite.py imports, at the versions of the project's own environment. pyautoattack's wheel carries
# a 44 MB example model that nothing here reads; it is left out, to keep the copy small.
#
#   bash benchmarks/gpu_packages.sh
#   # then, on the GPU machine, with .gpu_packages/ copied along with the working tree:
#   PYTHONPATH=$PWD/.gpu_packages python3 benchmarks/gpu_suite.py --out gpu_suite.json
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu_packages
python3 -m pip install --quiet --no-deps --no-compile --only-binary=:all: --target .gpu_packages \
    --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    jsonargparse==4.53.0 docstring_parser==0.18.0 typeshed_client==2.15.0 importlib_resources==7.1.0 \
    kornia==0.9.0 kornia_rs==0.2.0 webdataset==1.0.2 braceexpand==0.1.7 timm==1.0.31 pyautoattack==0.2.0
rm -rf .gpu_packages/pyautoattack/examples .gpu_packages/bin
du -sh .gpu_packages
