# wsitrain with CUDA: docker build -t wsitrain . && docker run --gpus all -v $PWD/slides:/slides -v $PWD/runs:/runs wsitrain
# The base image brings torch 2.6.0 + torchvision built for CUDA 12.6 with cuDNN 9.5 (the cu126 wheels' cuDNN); pip
# keeps them (they satisfy pyproject.toml). torch >= 2.6 with cuDNN >= 9.3 runs convolutions above 2^31 elements
# per sample in cuDNN (older ones fall back to im2col, ~9x the input), so plans made in this image may use them.
# CUDA 12.6, not 12.8: the cu128 builds drop Volta (sm 7.0), and the V100 presets are Volta.
# Another base (e.g. a site's own PyTorch image): docker build --build-arg BASE=... -t wsitrain .
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

# Run as an unprivileged user. /work is the working directory, so the default log.dir `runs` is /work/runs:
# link it to the /runs volume, so results land on the host without changing any config.
RUN useradd --create-home --uid 1000 wsitrain \
    && mkdir -p /work /slides /runs \
    && ln -s /runs /work/runs \
    && chown -R wsitrain:wsitrain /work /slides /runs \
    && chmod 1777 /work
# 1777 (like /tmp): `docker run --user $(id -u):$(id -g)` works too, e.g. for the synthetic slide cache in /work/.cache.
ENV MPLCONFIGDIR=/tmp/matplotlib
COPY --chown=wsitrain:wsitrain configs /work/configs

USER wsitrain
WORKDIR /work
VOLUME ["/slides", "/runs"]

ENTRYPOINT ["wsitrain"]
CMD ["--help"]
