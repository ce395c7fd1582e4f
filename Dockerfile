# wsitrain with CUDA: docker build -t wsitrain . && docker run --gpus all -v $PWD/slides:/slides -v $PWD/runs:/runs wsitrain
# The base image brings torch 2.5.1 + torchvision built for CUDA 12.4; pip keeps them (they satisfy pyproject.toml).
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

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
