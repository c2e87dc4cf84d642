// Stand-in for Insight's ThreadPool.h: see insight_stubs.h.
#pragma once
#include "insight_stubs.h"
