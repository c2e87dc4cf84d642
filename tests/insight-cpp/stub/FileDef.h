// Stand-in for Insight's FileDef.h: see insight_stubs.h.
#pragma once
#include "insight_stubs.h"
