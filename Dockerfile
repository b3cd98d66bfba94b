# One image for every llmbus service: `docker run llmbus <gateway|tokenizer|scheduler|worker|serve|...>`.
# Build stage: a virtualenv with the project installed from pyproject.toml (the same
# dependency pins `make install` uses; EXTRAS adds optional groups, e.g. "test").
FROM python:3.11-slim AS build
ARG EXTRAS=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/llmbus
ENV PATH=/opt/llmbus/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY llmbus ./llmbus
COPY shared ./shared
COPY services ./services
COPY kernels ./kernels
RUN pip install --upgrade pip && pip install ".${EXTRAS:+[$EXTRAS]}"

# Run stage: the virtualenv only, as an unprivileged user.
FROM python:3.11-slim
# g++ builds the CPU kernels (kernels/cpu) for the CPU the worker lands on, at its first
# start; without it the worker runs on PyTorch's ops alone.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 10001 llmbus && mkdir -p /models && chown llmbus /models
COPY --from=build /opt/llmbus /opt/llmbus
ENV PATH=/opt/llmbus/bin:$PATH \
    LLMBUS_HOME=/models \
    PYTHONUNBUFFERED=1
USER llmbus
WORKDIR /home/llmbus
EXPOSE 8000
ENTRYPOINT ["llmbus"]
CMD ["--help"]
