// Stand-in for Insight's ModuleRequestHandler.h: see insight_stubs.h.
#pragma once
#include "insight_stubs.h"
