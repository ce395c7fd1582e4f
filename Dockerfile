# wsitrain with CUDA: docker build -t wsitrain . && mkdir -p runs &&
#   docker run --gpus all --user $(id -u):$(id -g) -v $PWD/slides:/slides:ro -v $PWD/runs:/runs wsitrain fit ...
# The base image brings torch 2.6.0 + torchvision built for CUDA 12.6 with cuDNN 9.5 (the cu126 wheels' cuDNN); pip
# keeps them (they satisfy pyproject.toml). torch >= 2.6 with cuDNN >= 9.3 runs convolutions above 2^31 elements
# per sample in cuDNN (older ones fall back to im2col, ~9x the input), so plans made in this image may use them.
# CUDA 12.6, not 12.8: the cu128 builds drop Volta (sm 7.0), and the V100 presets are Volta.
# Another base (e.g. a site's own PyTorch image): docker build --build-arg BASE=... -t wsitrain . It needs python with
# pip, torch and torchvision on PATH; scripts/container/build-local.sh makes one from Debian's packages (CPU only).
ARG BASE=pytorch/pytorch:2.6.0-cuda12.6-cudnn9-runtime
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Install the package from a copy of the source (only what the build needs, see .dockerignore).
WORKDIR /opt/wsitrain
COPY pyproject.toml README.md ./
COPY wsitrain ./wsitrain
# openslide-bin ships the OpenSlide C library as a wheel, so no apt packages are needed.
RUN pip install . && wsitrain --version

# Runs as any uid: `docker run --user $(id -u):$(id -g)` (the caller, so results on the host are theirs) has no entry
# in /etc/passwd, so nothing may depend on one. HOME is /work (mode 1777, like /tmp), so whatever follows HOME lands
# under /work whatever the uid: torch hub, huggingface and the calibration files in ~/.cache, matplotlib in
# ~/.cache and ~/.config, and the demo's synthetic slides in .cache/wsitrain/synthetic (relative to /work).
# getpass.getuser() fails for such a uid; nothing wsitrain runs calls it (torch.compile's cache folder does, and falls
# back to the uid). The default log.dir `runs` is /work/runs: a link to the /runs volume, so results land on the host
# without changing any config; /runs is 1777 too, so the anonymous volume docker makes when none is mounted is
# writable by any uid. Without --user the container runs as `wsitrain` (uid 1000).
COPY docker/entrypoint.sh /usr/local/bin/wsitrain-entrypoint
RUN chmod 755 /usr/local/bin/wsitrain-entrypoint \
    && useradd --uid 1000 --home-dir /work --no-create-home wsitrain \
    && mkdir -p /work /slides /runs \
    && ln -s /runs /work/runs \
    && chmod 1777 /work /runs
ENV HOME=/work
COPY configs /work/configs

USER wsitrain
WORKDIR /work
VOLUME ["/slides", "/runs"]

# The entrypoint checks that ./runs (/runs) is writable by the uid (exit 2 with the fix when not), then runs
# `wsitrain ARGS`, or ARGS itself when it starts with torchrun, python, python3, sh or wsitrain.
ENTRYPOINT ["/usr/local/bin/wsitrain-entrypoint"]
CMD ["--help"]
